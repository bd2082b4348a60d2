"""How the CLI shows its reports with Rich: tables and notes on stdout (`out`), the verdict's
problems on stderr (`err`); `--json` documents are printed by `print_json`. Only report dicts and
plans come in; nothing here calls the library. Every string that comes from a checkpoint, an output or
a path is shown through `literal` (markup) or `printable` (plain text): its control characters escaped,
its brackets literal; JSON escapes them itself."""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moeconv.errors import human_bytes, printable

# Piped into a file or another program (no terminal, no COLUMNS), tables are as wide as their paths and
# names, not folded at Rich's default of 80 columns.
PIPED_WIDTH = 400
out = Console(emoji=False)  # a path's `:thumbsup:` is printed as it is, never as an emoji
err = Console(stderr=True, emoji=False)
for _console in (out, err):
    if not _console.is_terminal and "COLUMNS" not in os.environ:
        _console.width = PIPED_WIDTH


def literal(value: Any) -> str:
    """A name, path or message for a Rich markup string: shown as it is, never as markup or as a control."""
    return escape(printable(str(value)))


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def key_values(title: str, rows: list[tuple[str, Any]]) -> Table:
    table = Table(title=literal(title), show_header=False, title_justify="left")
    table.add_column(style="bold", overflow="fold")
    table.add_column(overflow="fold")  # wrap long paths and tensor names rather than cut them
    for key, value in rows:  # keys are markup (data in them through `literal`); values are data
        table.add_row(key, literal(value))
    return table


def print_inspect(report: dict[str, Any], title: str) -> None:
    fmt = report["format"]
    shapes = report["expert_shapes"]
    rows = [
        ("architecture", report["architecture"]),
        ("format", ", ".join(f"{k}={v}" for k, v in fmt.items())),
        ("MoE layers", f"{len(report['moe_layers'])} ({report['moe_layers'][0]} ...)"),
        ("experts per layer", report["experts_per_layer"]),
        ("expert shapes (out x in)", f"gate/up {shapes['gate'][0]}x{shapes['gate'][1]}, "
                                     f"down {shapes['down'][0]}x{shapes['down'][1]}"),
        ("scale dtype", report["scale_dtype"]),
        ("total / expert bytes", f"{human_bytes(report['total_bytes'])} / {human_bytes(report['expert_bytes'])}"),
        ("tensors / shards", f"{report['tensors']} / {len(report['shards'])}"),
    ]
    stacked = report.get("stacked_experts")
    if stacked:
        rows.append(("experts stacked on disk", "; ".join(f"{tensor}: {' + '.join(held)}"
                                                          for tensor, held in stacked["tensors"].items())))
        rows.append(("gate/up rows", stacked["gate_up_rows"]))
        rows.append(("expert 0 reads", "; ".join(f"{projection}: {', '.join(names)}"
                                                 for projection, names in stacked["expert_0_of_first_layer"].items())))
        rows.append(("expert biases", stacked["expert_biases"]))
        rows.append(("router (passed through)", ", ".join(stacked["router"]) or "none"))
    detection = report["detection"]
    rows.append(("format evidence", "; ".join(detection["evidence"]) or "-"))
    for disagreement in detection["disagreements"]:
        rows.append(("[red]config disagrees[/]", disagreement))
    for undecided in detection.get("undecided", []):
        rows.append(("[yellow]undecided[/]", undecided))
    for advice in detection.get("advice", []):
        rows.append(("[yellow]what to do[/]", advice))
    for module, case in report["act_order"].items():
        rows.append((f"{'[red]' if case.startswith('refused') else ''}act-order {literal(module)}", case))
    refused = report.get("convert_refuses")
    if refused:
        rows.append(("[red]convert refuses until you decide[/]", literal(refused)))
    once = " once you decide (above)" if refused else ""
    for name, verdict in report["backends"].items():
        serve = "; ".join(f"served by {served['engine']}" if served["engine"] else f"not with {engine}: {served['how']}"
                          for engine, served in (("vLLM", verdict["serving"]), ("SGLang", verdict["sglang_serving"])))
        if verdict["eligible"]:
            text = f"eligible{once}; {serve}"
        elif verdict["eligible_with_regroup"]:
            text = (f"eligible{once} with --regroup (group size / {verdict['regroup_factor']}): {verdict['reason']}; "
                    f"{serve}")
        else:
            text = f"NOT eligible: {verdict['reason']}"
        rows.append((f"backend {name} (tp={report['tp']})", text))
    rows.append((f"backend auto (tp={report['tp']})", f"{report['auto']}{once}"))
    rows += cast_rows(report.get("casts", {}))
    rows += audit_rows(report)
    out.print(key_values(title, rows))


def cast_rows(found: dict[str, Any]) -> list[tuple[str, str]]:
    """The census of each cast of float codes (inspection.cast_census): all blocks exact, or the exceptions."""
    rows = []
    for entry in found.values():
        blocks, exact = entry["blocks"], entry["exact"]
        share = f"{math.floor(10000 * exact / blocks) / 100:g}%" if blocks else "-"  # 99.99%, never a rounded 100%
        if exact == blocks and not entry["refused"]:
            rows.append((f"cast {entry['label']}", f"{share} of {blocks:,} blocks exact"))
            continue
        text = f"{share} of {blocks:,} blocks exact ({exact:,})"
        if entry["inexact"]:
            first = entry["inexact"][0]
            text += (f"; {len(entry['inexact'])} of {entry['linears']} linears with inexact blocks (first: "
                     f"{first['tensor']}, {first['blocks'] - first['exact']} inexact block(s)); worst relative error "
                     f"{_error(entry['worst_relative_error'])}")
        if entry["reserved"]:
            text += f"; {entry['reserved']} blocks hold a scale byte reserved for NaN"
        if entry["refused"]:
            text += f"; {len(entry['refused'])} linears unreadable (first: {entry['refused'][0]['tensor']})"
        rows.append((f"[yellow]cast {literal(entry['label'])}[/]", text))
    return rows


def _error(value: float | str) -> str:
    """A relative error for a reader: inf (an overflow) and 1 (a value flushed to 0) said in words."""
    if isinstance(value, str):
        return f"{value} (a value overflows the target)"
    return f"{value:.2g}" + (" (a value flushed to 0)" if value == 1.0 else "")


def audit_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The audits' lines of a report (inspect, convert or verify JSON), when there is anything to say."""
    rows = []
    if report.get("suspicious_zero_slots"):
        found = report["suspicious_zero_slots"]
        rows.append(("v1 zero slots stored as all ones",
                     f"{found['count']} (decoded as zero 0, GPTQModel's convention; first: {found['first_tensor']})"))
    if report.get("nonfinite_scales"):
        found = report["nonfinite_scales"]
        rows.append(("[red]NaN or infinite scales[/]",
                     f"{found['count']} (converted as they are; no kernel can use them; first: {found['first_tensor']})"))
    return rows


def memory_line(report) -> str:
    """The whole process tree's peak (PSS: shared pages counted once), its largest worker, this process's."""
    parts = []
    if report.tree_peak_pss_mb is not None:
        worker = (f", largest worker {report.largest_worker_pss_mb:.0f} MB"
                  if report.largest_worker_pss_mb is not None else "")
        parts.append(f"{report.tree_peak_pss_mb:.0f} MB, the whole process tree (PSS{worker})")
    if report.peak_rss_mb is not None:
        parts.append(f"this process {report.peak_rss_mb:.0f} MB (RSS)")
    return "; ".join(parts) or "-"


def print_next_steps(plan, output: Path, converted: bool = True) -> None:
    """The report's last lines: how to check the output, and how each engine serves it (or why it does not)."""
    quoted = shlex.quote(str(output))
    if converted:
        out.print(printable(f"next: moeconv verify {quoted}"), highlight=False, soft_wrap=True, markup=False)
    for engine, serving in (("vLLM", plan.serving), ("SGLang", plan.sglang_serving)):
        line = (f"serve: {serving.engine}: {serving.how.format(output=quoted)}" if serving.engine
                else f"serve: not with {engine} as it is: {serving.how}")
        out.print(printable(line), highlight=False, soft_wrap=True, markup=False)


def detection_notes(plan) -> list[str]:
    """What the data could not decide, and which side a --trust flag followed."""
    detection = plan.detection
    if detection is None:
        return []
    notes = [f"decided by you, not by the data: {what}" for what in detection.decided_by_user]
    cast = plan.scale_cast
    if cast:
        stored, model = cast
        notes.append(f"note: the scales are {stored} but the model dtype is {model}: vLLM creates this schema's "
                     f"scale parameters in {model} and casts them at load, which changes the scales {model} cannot "
                     f"hold exactly (verify counts them); serve with --dtype {stored} to keep them exact")
    if detection.disagreements and plan.trust:
        notes += [f"following the {plan.trust} (--trust-{plan.trust}): {disagreement}"
                  for disagreement in detection.disagreements]
    return notes


def print_verify(report) -> None:
    """The report's rows, the per-layer table, the failures, and a last line with the verdict."""
    level = report.level
    structure = "ok" if not report.structure_problems else f"{len(report.structure_problems)} problem(s)"
    lossless = level != "structure" and not report.structure_problems
    numerics = report.numerics_device is not None
    not_run = ("not run (the structure check failed)" if report.structure_problems
               else f"not run (--level {level})" if level != "numerics" else "not run")
    out.print(key_values(f"verify {report.output}", [
        ("source", report.source),
        *[("decided by the user, not the data", what) for what in report.decided_by_user],
        ("structure, index, configs, digests", structure),
        ("source shards hashed as recorded", f"{report.source_files_checked - len(report.source_problems)}"
                                             f"/{report.source_files_checked}" if lossless else not_run),
        ("provenance", report.provenance),
        ("levels proven (docs/FORMAT.md)", ", ".join(report.proven) or "none"),
        ("pass-through tensors byte-identical", f"{report.passthrough_checked - len(report.passthrough_problems)}"
                                                f"/{report.passthrough_checked}" if lossless else not_run),
        *([("dense linears bit-exact", f"{report.dense_linears_checked - len(report.dense_linear_problems)}"
                                       f"/{report.dense_linears_checked}")] if report.dense_linears_checked else []),
        ("kernel device", report.numerics_device or not_run),
        *([("tolerance (relative error)", f"{report.tolerance:g}")] if numerics else []),
        *audit_rows({"nonfinite_scales": report.nonfinite_scales}),
        *([("scales the engine's cast changes", cast_line(report.engine_scale_cast))]
          if report.engine_scale_cast.get("checked") else []),
    ]))
    table = Table(title_justify="left", caption_justify="left")
    table.add_column("MoE layer", overflow="fold")  # long module names wrap; the numbers never do
    headers = (("bit-exact", "routed", "rel err", "max abs", "time", "result") if numerics
               else ("bit-exact", "time", "result"))
    for header in headers:
        table.add_column(header, no_wrap=True)
    shown = shown_layers(report.layers)
    for layer in shown:
        errors = ["-" if layer.experts_routed is None else f"{layer.experts_routed}/{layer.experts}"
                  + ("" if layer.blocks_checked is None else f", {layer.blocks_checked} blocks"),
                  "-" if layer.relative_error is None else f"{layer.relative_error:.1e}",
                  "-" if layer.max_abs_error is None else f"{layer.max_abs_error:.1e}"]
        sampled = f" of {layer.experts}" if layer.experts_checked < layer.experts else ""
        table.add_row(literal(layer.module), f"{layer.experts_exact}/{layer.experts_checked}{sampled}",
                      *(errors if numerics else []), f"{layer.seconds:.2f} s",
                      "[green]ok[/]" if layer.ok else "[red]FAIL[/]")
    if numerics:
        scale = max((layer.max_abs_reference for layer in report.layers if layer.max_abs_reference is not None),
                    default=0.0)
        table.caption = escape(f"rel err = ||out - ref|| / ||ref||, against a float64 reference of the source, is what "
                               f"is checked (<= {report.tolerance:g}); max abs is the largest single difference, for "
                               f"scale: the reference's outputs reach |ref| = {scale:.2g}; routed: the experts the "
                               f"random tokens reached (each checked expert gets one at least)"
                               + ("; blocks: the FP4 scale blocks of theirs the kernel decoded"
                                  if any(layer.blocks_checked for layer in report.layers) else ""))
    if len(shown) < len(report.layers):
        table.add_row(f"... {len(report.layers) - len(shown)} more MoE layers, every one ok (--json lists each)",
                      *[""] * len(headers))
    if report.layers:
        out.print(table)
    for problem in report.failures()[:20]:
        err.print(f"[red]x[/] {literal(problem)}", highlight=False, soft_wrap=True)
    out.print(printable(verdict(report)), highlight=False, soft_wrap=True, markup=False)


LAYER_ROWS = 16  # the per-layer table's rows: the first of them, then every failing layer, then a count


def shown_layers(layers: list) -> list:
    """The layers the table lists: all of them up to LAYER_ROWS, else the first LAYER_ROWS and every one that
    failed (the rest are counted in one row)."""
    if len(layers) <= LAYER_ROWS:
        return list(layers)
    return list(layers[:LAYER_ROWS]) + [layer for layer in layers[LAYER_ROWS:] if not layer.ok]


def cast_line(cast: dict[str, Any]) -> str:
    """How many checked scales the engine's cast to the model dtype changes (VerifyReport.engine_scale_cast)."""
    return (f"{cast['changed']} of {cast['checked']} change when cast from {cast['stored']} to the model dtype "
            f"{cast['model']} (largest relative change {cast['max_relative_change']:.2g}); serve with "
            f"--dtype {cast['stored']} to keep them exact")


def verdict(report) -> str:
    """One line: passed or failed, what was checked, and every caveat the rows above carry."""
    if not report.ok:
        return f"verdict: FAILED, {len(report.failures())} check(s) failed (listed above)"
    checked = ["structure and digests"]
    if report.source_files_checked:
        checked.append(f"{report.source_files_checked} source shard(s) as recorded")
    if report.layers:
        experts = sum(layer.experts_checked for layer in report.layers)
        census = report.cast_census
        checked.append(f"{experts} expert(s) in {len(report.layers)} MoE layer(s) " + (
            f"cast from the source as recorded ({census.get('label')}: {census.get('exact')} of {census.get('blocks')} "
            f"blocks exact, every value of them equal to the source's, the census recomputed)" if census
            else "bit-exact against the source"))
    kernels = sum(layer.relative_error is not None for layer in report.layers)
    blocks = sum(layer.blocks_checked or 0 for layer in report.layers if layer.relative_error is not None)
    decoded = (f" ({sum(layer.experts_routed or 0 for layer in report.layers if layer.relative_error is not None)} "
               f"expert(s), {blocks} FP4 block(s) decoded in the kernel)" if blocks else "")
    if kernels and report.kernel_sample:
        few = f", {report.kernel_experts} expert(s) of each" if report.kernel_experts else ""
        checked.append(f"kernel within {report.tolerance:g} on a sample of {kernels} of {len(report.layers)} layers "
                       f"({', '.join(report.kernel_sample)}{few}; --level numerics for all){decoded}")
    elif kernels:
        checked.append(f"kernel within {report.tolerance:g} on {kernels} layer(s){decoded}")
    anchor = report.source_anchor
    where = (f"source anchored to {anchor['repo']}@{anchor['revision']}" if anchor and report.published_files_checked
             else f"source recorded as {anchor['repo']}@{anchor['revision']}, not checked at this level" if anchor
             else report.provenance.split(":", 1)[0])  # "source not anchored (a local folder)", or a prefix
    level = "verify's default level" if report.kernel_sample else f"--level {report.level}"
    caveats = "".join(f"; caveat: {caveat}" for caveat in report.caveats())
    return f"verdict: ok ({', '.join(checked)}; {where}; {level}){caveats}"


def print_plan(summary: dict[str, Any]) -> None:
    rows = [(key, summary[key]) for key in ("source", "backend", "layout_version", "architecture", "moe_layers")]
    rows.append(("format", ", ".join(f"{k}={v}" for k, v in summary["format"].items())))
    rows.append(("bytes in / out", f"{human_bytes(summary['source_bytes'])} / {human_bytes(summary['output_bytes'])}"))
    out.print(key_values("plan (nothing written)", rows))
    table = Table("shard", "bytes", "tensors", title_justify="left")
    for shard in summary["shards"]:
        table.add_row(literal(shard["file"]), human_bytes(shard["bytes"]), str(shard["tensors"]))
    out.print(table)
