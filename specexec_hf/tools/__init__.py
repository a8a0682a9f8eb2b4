"""Tools built on the library, never imported by it: the ``specexec-hf`` command line (:mod:`.cli`), draft
distillation (:mod:`.distill`), calibration (:mod:`.calibrate`), the benchmark and its acceptance measurement
(:mod:`.bench`, :mod:`.acceptance`) and the shipped prompt sets (:mod:`.prompts`)."""
