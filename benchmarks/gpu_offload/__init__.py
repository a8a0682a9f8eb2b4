"""An offloaded target on a GPU, measured against the physical limit: the host-to-device link.

Sections, in the order they run (each one is skipped, with the reason recorded, when the time budget is spent):

1. **Link**: pinned (and pageable) host-to-device copy bandwidth, timed with CUDA events. Pinned is the bound
   every offloaded forward is measured against.
2. **Forward time vs tokens scored** (1 ... 2048) for a random-weight Llama shape (default: Llama-3-8B in bf16)
   whose decoder layers and head sit in CPU RAM and are streamed to the GPU on every forward: the stream executor,
   accelerate's hooks, diffusers' group offloading (when diffusers is installed) and, as the compute floor, the
   same model resident on the GPU. Achieved GB/s = streamed bytes / forward time, as a share of the pinned bound.
   With ``--layers N`` fewer layers than the shape has are built; the forward time of the whole shape is then
   extrapolated by streamed bytes, and every such figure is labelled so. ``--weights int4`` (or ``int8``)
   quantizes the decoder layers' linear weights with optimum-quanto first (embedding, norms and head stay 16-bit)
   and streams their packed bytes; only the stream executor and the resident floor run then (e.g. the paper's
   setting: ``--shape llama-70b --weights int4 --layers 8``).
3. **Draft**: tree growth (``SpecExecCandidateGenerator.grow_tree``) of a random-weight draft of realistic size
   (Llama-3.2-1B shape) on the GPU, per budget, and one cached 1-token draft forward (what HF assisted generation
   runs per drafted token).
4. **End to end** on the real default pair (SmolLM2-135M-Instruct + the shipped draft) with the target's layers
   in CPU RAM: plain generate(), HF assisted generation and SpecExec at several budgets, each executor; every
   output is compared with the in-memory target's greedy output. Each method is warmed up by an untimed generation
   of the full length, then ``--prompts`` (at least 3) are timed: the median prompt's tokens/s, and its seconds
   split into the target's forwards, the draft's forwards and the host's rest, the forwards timed by CUDA events on
   a GPU (by host clocks on a CPU). It also measures the pair's tokens per target forward and draft forwards per
   tree, which the projection uses.
5. **Projection** of tokens/s for the big shape from measured parts only: tokens per target forward of the real
   pair (this run's section 4, else the CPU figures in ``benchmarks/results/bench_t0*/bench.json``) over (target
   forward time at that many tokens + tree-growth time = seconds per draft forward of the GPU draft x the real
   pair's draft forwards per tree); plain offloaded generate() and HF assisted computed the same way. Then the
   paper's and UMbreLLa's published figures, normalised by link speed as tokens per weight-stream time.
6. **In one loop** (section ``in_loop``, ``in_loop.py``): the default pair's real trees and chains on real held-out
   prompts verified, one forward per step, by big random targets streamed from pinned RAM (Llama-3-8B bf16; Llama-3-70B
   with int4 layers, ``--in-loop-int4-layers`` of them, when optimum-quanto is present), each step's accepted path
   replayed from the pair's own walk, the small target's forwards timed apart and not counted: SpecExec
   (``--in-loop-budgets``), HF assisted and plain streamed decoding in the same run, their ratios, and the int4
   target's share of its link-bound ideal, normalised to PCIe 4.0 x16 beside the published systems.
7. **Largest bf16 shape the host holds** (section ``largest``), stream executor only.
8. **The SSD tier** (section ``disk``): a random-weight bf16 checkpoint of the Llama-3.2-1B shape (2.5 GB) written
   to the machine's own disk (``--disk-dir``, else the first of $TMPDIR, /tmp, /var/tmp with room and ``O_DIRECT``),
   the disk's direct-read bound measured on it (best of up to 3 cold whole-file reads, ``loaders.disk_bound``),
   then the model loaded with every decoder layer on disk and timed by the stream executor over 1, 16, 64 and 256
   tokens: disk -> pinned staging (direct reads) -> GPU. Seconds, GB/s and share of the bound; the checkpoint is
   deleted afterwards.

**Every figure is checked before it is written** (``figure_checks.py``): seconds, tokens/s, GB/s and ratios finite and
above zero, forward time not falling as tokens grow beyond the repeats' spread, achieved GB/s at most 1.05x the
measured bound, a time split within its whole; goals, whole-shape extrapolations and projections made only from
figures that passed. A figure that fails is withheld from the tables with what was derived from it, listed with why,
its section marked FAILED, and the run exits with status 4 (1 when a section also failed).

``--sections`` picks sections 1-4 and 6-8 (default: all); the projection is remade from whatever the report holds
each time it is written. The report (gpu_offload.json, .md, .png in ``--out``) is written after every section, so a
section that fails or is killed loses only its own figures: a section that started and never finished says so.
``--merge`` starts from earlier reports (e.g. one per device call, see ``scripts/gpu_check``): their sections are
kept, and the projection combines them.

The random-weight models are made in this process: nothing is downloaded; each shape's weights are built once and
shared by the executors measured on it. ``--tiny`` runs the same sections on a CPU (tiny shapes; for the stream
executor, in the disk section too, ``OrderCheckingDevice`` stands in for the GPU; for accelerate the layers go to
disk; a host memcpy stands in for the link; the end to end section on the synthetic pair of
``benchmarks/synthetic_models.py`` unless ``--pair`` says otherwise): it checks the code paths, its figures mean
nothing.

Run: python -m benchmarks.gpu_offload --out DIR [--tiny] [--sections ...] [--merge FILE ...] [--time-budget 330]
                                      [--layers N] [--pair auto] [--disk-dir DIR] [--in-loop-budgets 256 1024]
"""

