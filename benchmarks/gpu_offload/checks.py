"""Every figure of the report checked before it is written (:mod:`benchmarks.figure_checks`); a figure that fails is
withheld with what was derived from it, and the projections are remade from those that passed."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

from benchmarks.figure_checks import (
    MEASURED,
    STAND_IN,
    FigureAudit,
    Noise,
    non_negative,
    not_falling,
    parts_within,
    positive,
    positive_curve,
    within_bound,
)
from benchmarks.gpu_offload.forward import forward_goals
from benchmarks.gpu_offload.projection import (
    PUBLISHED,
    RESULTS,
    pair_rates_from_cpu_results,
    pair_rates_from_run,
    project,
    published_comparison,
    ratios,
)


def check_figures(report: dict[str, Any], tiny: bool) -> None:
    """Checks every figure of ``report`` before it is written (:mod:`figure_checks`; on the CPU stand-in with the slack
    of ``STAND_IN``), then remakes the figures derived from those that passed (projections, the published comparison)
    and checks them in turn.

    A figure that fails is withheld with the figures derived from it (moved under its entry's ``withheld``, which
    nothing reads), its entry marked ``FAILED: why``; the failure is listed in ``report["figure_failures"]``, its
    section marked FAILED, and :func:`main` exits non-zero. Figures withheld once are not checked again, so a report
    saved after every section lists each failure once.
    """
    audit = FigureAudit(STAND_IN if tiny else MEASURED)
    check_link(report.get("link"), audit)
    bound = (report.get("link") or {}).get("pinned_gbps")
    for shape_result in report["shapes"]:
        check_shape(shape_result, bound, audit)
    check_draft(report.get("draft"), audit)
    check_disk(report.get("disk"), audit)
    check_end_to_end(report.get("end_to_end"), audit)
    remake_projections(report, tiny, audit)
    failures = [failure for failure in report.get("figure_failures", []) if failure["section"] != "projection"]
    report["figure_failures"] = failures + [failure for failure in audit.failures if failure not in failures]
    for failure in report["figure_failures"]:
        section = report["sections"].get(failure["section"])
        if section is not None and not section["status"].startswith("FAILED"):
            section["status"] = f"FAILED: {failure['figure']}: {failure['why']}"


def check_entry(
    entry: dict[str, Any], section: str, audit: FigureAudit, checks: list[tuple[tuple[str, ...], Callable[[], Any]]]
) -> None:
    """Runs ``checks`` on ``entry``'s figures in order, each ``(the keys of the figures it checks, the check)``: at
    the first that fails, its figures and those of every later check (derived from them) are withheld."""
    for position, (_, check) in enumerate(checks):
        if not audit.passes(section, check):
            withheld = entry.setdefault("withheld", {})
            for keys, _ in checks[position:]:
                withheld.update({key: entry.pop(key) for key in keys if key in entry})
            failure = audit.failures[-1]
            entry["status"] = f"FAILED: {failure['figure']}: {failure['why']}"
            return


def check_positive(name: str, entry: dict[str, Any], keys: tuple[str, ...]) -> None:
    """The figures ``keys`` of ``entry`` are positive (absent or ``None``: not a figure, e.g. no profiler ran, or
    withheld already)."""
    for key in keys:
        if entry.get(key) is not None:
            positive(f"{name}: {key}", entry[key])


def check_bandwidth(name: str, entry: dict[str, Any], share_key: str, bound_gbps: float | None, noise: Noise) -> None:
    """An entry's achieved GB/s per token count within ``noise.over_bound`` of the measured bound (positive only
    where none was measured), and its shares of that bound positive."""
    for tokens, gbps in entry.get("achieved_gbps", {}).items():
        figure = f"{name}: GB/s over {tokens} tokens"
        if bound_gbps is None or not math.isfinite(bound_gbps):
            positive(figure, gbps)
        else:
            within_bound(figure, gbps, bound_gbps, noise)
    for tokens, share in entry.get(share_key, {}).items():
        positive(f"{name}: share of the bound over {tokens} tokens", share)


def check_link(link: dict[str, Any] | None, audit: FigureAudit) -> None:
    """The link's GB/s, pinned and pageable, positive."""
    if link:
        keys = ("pinned_gbps", "pinned_gbps_max", "pageable_gbps")
        check_entry(link, "link", audit, [(keys, partial(check_positive, "link", link, keys))])


def check_shape(shape_result: dict[str, Any], bound_gbps: float | None, audit: FigureAudit) -> None:
    """Each measured executor's forward seconds (rising with tokens), achieved GB/s (within the link's bound) and
    whole-shape extrapolation (a positive scale, positive seconds); then the goals, from what passed."""
    shape, layers = shape_result["shape"], shape_result["layers_built"]
    section = shape_result.get("section") or f"forward {shape['name']} x{layers} layers"
    for executor, entry in shape_result["executors"].items():
        if entry.get("status") != "measured":
            continue
        name = f"{shape['name']} {shape_result['dtype']} x{layers} layers, {executor}"
        check_entry(entry, section, audit, [
            (("seconds", "seconds_spread"), partial(check_forward_seconds, name, entry, audit.noise)),
            (("achieved_gbps", "share_of_pinned_link"), partial(
                check_bandwidth, name, entry, "share_of_pinned_link", bound_gbps, audit.noise)),
            (("full_shape_seconds", "full_shape_scale", "full_shape_streamed_bytes"), partial(
                check_extrapolation, name, entry)),
        ])
    shape_result["goals"] = []
    audit.passes(section, lambda: shape_result.update(goals=forward_goals(shape_result)))


def check_forward_seconds(name: str, entry: dict[str, Any], noise: Noise) -> None:
    """Forward seconds per token count: positive, and not falling as tokens grow beyond the repeats' spread."""
    not_falling(f"{name}: forward seconds", entry.get("seconds") or {}, entry.get("seconds_spread"), noise)


def check_extrapolation(name: str, entry: dict[str, Any]) -> None:
    """The whole shape's forward seconds positive, and the scale and streamed bytes they were made with."""
    positive_curve(f"{name}: full-shape forward seconds", entry.get("full_shape_seconds") or {})
    check_positive(name, entry, ("full_shape_scale", "full_shape_streamed_bytes"))


def check_draft(draft: dict[str, Any] | None, audit: FigureAudit) -> None:
    """The draft's cached 1-token forward, its tree-feed forwards and each budget's tree: positive seconds and
    forward counts."""
    if not draft:
        return
    one_token = ("one_token_forward_seconds", "one_token_forward_kernel_seconds")
    check_entry(draft, "draft", audit, [(one_token, partial(check_positive, "draft", draft, one_token))])
    feed = draft.get("tree_feed")
    if feed:
        timed = ("dynamic_cache_seconds", "static_cache_seconds", "cuda_graph_seconds")
        check_entry(feed, "draft", audit, [(timed, partial(check_positive, "draft tree feed", feed, timed))])
    tree = ("tree_seconds", "draft_forwards", "seconds_per_draft_forward", "tree_kernel_seconds")
    for budget, row in draft.get("budgets", {}).items():
        if "tree_seconds" in row:
            check_entry(row, "draft", audit, [(tree, partial(check_positive, f"draft, budget {budget}", row, tree))])


def check_disk(disk: dict[str, Any] | None, audit: FigureAudit) -> None:
    """The SSD tier's forward seconds (rising with tokens) and GB/s from disk (within its direct-read bound)."""
    if not disk or disk.get("status") != "measured":
        return
    bound = (disk.get("bound") or {}).get("gbps")
    check_entry(disk, "disk", audit, [
        (("seconds", "seconds_spread"), partial(check_forward_seconds, "SSD tier", disk, audit.noise)),
        (("achieved_gbps", "share_of_disk_bound", "goals"), partial(
            check_bandwidth, "SSD tier", disk, "share_of_disk_bound", bound, audit.noise)),
    ])

GENERATION_FIGURES = ("tokens_per_second", "tokens_per_second_per_prompt", "tokens_per_target_forward",
                      "draft_forwards_per_target_forward", "seconds")


def check_end_to_end(e2e: dict[str, Any] | None, audit: FigureAudit) -> None:
    """Each measured generation row: tokens/s positive, for every prompt too; its time split within its whole."""
    for executor, entry in (e2e or {}).get("executors", {}).items():
        for method, row in entry.get("methods", {}).items():
            if row.get("status") == "measured":
                check_entry(row, "end to end", audit, [(GENERATION_FIGURES, partial(
                    check_generation_row, f"end to end, {executor}, {method}", row, audit.noise))])


def check_generation_row(name: str, row: dict[str, Any], noise: Noise) -> None:
    positive(f"{name}: tokens/s", row.get("tokens_per_second"))
    for prompt, rate in enumerate(row.get("tokens_per_second_per_prompt", [])):
        positive(f"{name}: tokens/s of prompt {prompt}", rate)
    positive(f"{name}: tokens per target forward", row.get("tokens_per_target_forward"))
    drafted = non_negative(f"{name}: draft forwards per target forward", row.get("draft_forwards_per_target_forward"))
    split = row.get("seconds") or {}
    positive(f"{name}: seconds in target forwards", split.get("target_seconds"))
    (positive if drafted else non_negative)(f"{name}: seconds in draft forwards", split.get("draft_seconds"))
    parts_within(f"{name}: seconds of the median prompt", split.get("seconds"), {
        "in target forwards": split.get("target_seconds"), "in draft forwards": split.get("draft_seconds")}, noise)


def check_projected_row(name: str, row: dict[str, Any]) -> None:
    positive(f"projection {name}: tokens/s", row["tokens_per_second"])
    positive(f"projection {name}: target seconds", row["target_seconds"])
    non_negative(f"projection {name}: draft seconds", row.get("draft_seconds", 0.0))  # plain generate has none


def check_published_row(row: dict[str, Any]) -> None:
    positive(f"{row['system']}: tokens/s", row["tokens_per_second"][0])
    positive(f"{row['system']}: weight-stream seconds", row["weight_stream_seconds"])
    positive(f"{row['system']}: tokens per weight-stream", row["tokens_per_weight_stream"][0])


def add_ratios(projection: dict[str, Any]) -> None:
    """Set ``projection["ratios"]`` to its goals: the check :meth:`FigureAudit.passes` runs per projection."""
    projection["ratios"] = ratios(projection)


def remake_projections(report: dict[str, Any], tiny: bool, audit: FigureAudit) -> None:
    """Section 5 from what the report holds (its figures checked already): each measured shape with the draft's
    timing and the pair's rates; each projected figure checked in turn, one that fails withheld."""
    e2e = report.get("end_to_end")
    rates = pair_rates_from_run(e2e) if e2e and (e2e.get("real_pair") or tiny) else None
    rates = rates or pair_rates_from_cpu_results(RESULTS)
    report["projections"], ours = [], []
    link_gbps = (report.get("link") or {}).get("pinned_gbps", math.nan)
    for shape_result in report["shapes"]:
        if not (report.get("draft") and rates):
            break
        projection = project(shape_result, report["draft"], rates)
        projection["shape"] = f"{shape_result['shape']['name']} {shape_result['dtype']}"
        for executor, rows in projection["executors"].items():
            for method in list(rows):
                name = f"{projection['shape']}, {executor}, {method}"
                if not audit.passes("projection", partial(check_projected_row, name, rows[method])):
                    projection.setdefault("withheld", {})[f"{executor}: {method}"] = rows.pop(method)
        projection["ratios"] = []
        audit.passes("projection", partial(add_ratios, projection))
        report["projections"].append(projection)
        for row in published_comparison(projection, shape_result, link_gbps)[: -len(PUBLISHED)]:
            if audit.passes("projection", partial(check_published_row, row)):
                ours.append(row)
    report["published"] = ours + published_comparison({}, {"executors": {}}, link_gbps) if ours else []
