"""How well the data tells GPTQ v1 from v2 on checkpoints the real GPTQ algorithm quantized.

    python benchmarks/gptq_zero_format.py SET_DIR [--markdown]

SET_DIR holds what tests/packers/make_gptq_asym_set.py makes (run in .venv-packers): per case, GPTQModel's
v1 and v2 saves of one quantization, optionally auto-gptq's v1, and the quantizers' true zero points.
Every variant is inspected as labelled and relabelled with the other `checkpoint_format`; the table gives
moeconv's statistic (the per-group mean code minus the v2 reading's zero, trimmed-mean over groups; see
moeconv/formats/gptq.py), its decision, and whether the zero points moeconv would decode equal the
quantizer's. A decision is wrong when it names the format the checkpoint is not.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from moeconv.checkpoint.reader import open_checkpoint
from moeconv.formats.gptq import V1, V2
from moeconv.models import architecture_from_config
from moeconv.survey import detect_format


def relabel(folder: Path, to: Path, checkpoint_format: str) -> Path:
    """A copy of `folder` (shards hard-linked) whose configs say `checkpoint_format`."""
    to.mkdir(parents=True)
    for path in folder.iterdir():
        if path.suffix == ".safetensors":
            (to / path.name).hardlink_to(path)
        elif path.name in ("config.json", "quantize_config.json"):
            config = json.loads(path.read_text())
            section = config.get("quantization_config", config)
            section["checkpoint_format"] = section["format"] = checkpoint_format
            (to / path.name).write_text(json.dumps(config))
        elif path.is_file():
            shutil.copy(path, to / path.name)
    return to


def detect(folder: Path):
    checkpoint = open_checkpoint(folder)
    architecture = architecture_from_config(checkpoint.config, str(folder / "config.json"))
    return detect_format(checkpoint, architecture)


def decoded_zeros_match(folder: Path, version: str, truth: dict[str, torch.Tensor], key: str, bits: int) -> bool:
    from moeconv.formats.gptq import GPTQ

    reading = GPTQ(bits, -1, sym=False, checkpoint_format=version)
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as handle:
            for name in handle.keys():
                if not name.endswith(".qzeros") or ".mlp.experts." not in name:
                    continue
                prefix = name.removesuffix(".qzeros")
                words = reading.zero_offset_word()
                from moeconv import packing

                zeros = packing.unpack_array(packing.add_to_word_array(handle.get_tensor(name).numpy(), words), bits,
                                             axis=1).T
                if not torch.equal(torch.from_numpy(zeros.copy()), truth[f"{prefix}.{key}"]):
                    return False
    return True


def rows(set_dir: Path):
    for case_dir in sorted(path for path in set_dir.iterdir() if (path / "case.json").exists()):
        case = json.loads((case_dir / "case.json").read_text())
        with safe_open(str(case_dir / "truth.safetensors"), "pt") as handle:
            truth = {name: handle.get_tensor(name) for name in handle.keys()}
        variants = [("gptqmodel v1", "v1", V1, "zeros"), ("gptqmodel v2", "v2", V2, "zeros")]
        if (case_dir / "autogptq").exists():
            variants.append(("auto-gptq v1", "autogptq", V1, "autogptq_zeros"))
        for producer, sub, true_format, key in variants:
            for label in (true_format, V2 if true_format == V1 else V1):
                with tempfile.TemporaryDirectory(dir=case_dir) as tmp:
                    folder = relabel(case_dir / sub, Path(tmp) / "c", label)
                    configured, detection = detect(folder)
                    found = detection.detected.checkpoint_format if detection.detected else None
                    decided = None if detection.undecided else found
                    statistic = next((e for e in detection.evidence if "trimmed" in e), "")
                    used = decided or label
                    yield {
                        "case": case["name"], "bits": case["bits"], "group": case["group_size"],
                        "dist": case["dist"], "producer": producer, "truth": true_format, "label": label,
                        "decided": decided or "undecided", "wrong": decided not in (None, true_format),
                        "zeros_right_if_converted": decoded_zeros_match(case_dir / sub, used, truth, key,
                                                                        case["bits"]),
                        "statistic": statistic.split(": ", 1)[-1],
                    }


def _outcome(row: dict) -> str:
    """What convert does with this reading: the quantizer's zero points, a refusal, or wrong ones."""
    if row["decided"] == "undecided":
        return "refused"
    return "exact" if row["zeros_right_if_converted"] and not row["wrong"] else "WRONG"


def true_reading(row: dict) -> float:
    """The statistic under the checkpoint's true reading, from the evidence line."""
    v1, v2 = (float(part.split("reading ")[1].split()[0]) for part in row["statistic"].split(", ")[:2])
    return v1 if row["truth"] == V1 else v2


def main() -> None:
    set_dir = Path(sys.argv[1])
    table = list(rows(set_dir))
    if "--markdown" in sys.argv:  # one line per checkpoint: read as labelled, then relabelled
        print("| case | bits | g | weights | producer | true reading | as labelled | relabelled | convert (labelled / relabelled) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for labelled, relabelled in zip(table[::2], table[1::2]):
            zeros = " / ".join(_outcome(row) for row in (labelled, relabelled))
            group = "channel" if labelled["group"] == -1 else labelled["group"]
            print(f"| {labelled['case']} | {labelled['bits']} | {group} | {labelled['dist'].split('/')[0]} | "
                  f"{labelled['producer']} | {true_reading(labelled):+.2f} | {labelled['decided']} | "
                  f"{relabelled['decided']} | {zeros} |")
    else:
        for r in table:
            print(json.dumps(r))
    wrong = sum(r["wrong"] for r in table)
    undecided = sum(r["decided"] == "undecided" for r in table)
    print(f"{len(table)} readings: {wrong} wrong decisions, {undecided} undecided", file=sys.stderr)


if __name__ == "__main__":
    main()
