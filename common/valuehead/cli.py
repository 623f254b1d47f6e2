"""Command line: inspect a critic checkpoint, convert it to HF TokenClassification, print values.

  python -m critic_adapters.common.valuehead inspect PATH [--json]
  python -m critic_adapters.common.valuehead convert SRC DST [--dtype bfloat16] [--fresh-head] [--head-prefix P]
                                                             [--adapter ADAPTER_DIR]   # merge a peft LoRA adapter
                                                             [--max-shard-size 5GB]    # bytes per safetensors file
  python -m critic_adapters.common.valuehead values PATH [--tokens "1 2 3"] [--seed 0]
  python -m critic_adapters.common.valuehead values PATH --rollouts FILE --out values.parquet   # a whole rollout file
  python -m critic_adapters.common.valuehead demo OUT_DIR [--family F] [--vocab-size N]   # write the embedded tiny model, then use it
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

from ..learning.hl_gauss import describe
from .config import architecture_name, critic_class, text_hidden_size
from .errors import CriticLoadError
from .experts import describe_experts
from . import multimodal
from .load import load_critic, plan_load

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What both `values` outputs hold, as the trainer aligns old values and returns.
ALIGNMENT = ("values[t] is the critic's value for token t, read at position t-1 (the state before it); "
             "values[0] has none and is 0.0")


def would_initialise(head: str, detection=None) -> list[str]:
    """The head tensors load_critic initialises for a checkpoint of this detection (None: a model
    with no head at all)."""
    if detection is None or detection.head_weight is None:
        return [f"{head}.weight (fresh head)", f"{head}.bias (zero)"]
    if detection.head_bias is None:
        return [f"{head}.bias (zero: this format has no bias)"]
    return []


def inspect_checkpoint(path: str, *, head_prefix: str | None = None, trust_remote_code: bool = False,
                       plan=None) -> dict:
    """What load_critic would do with `path`, from config.json and tensor headers only (`plan`: its
    plan_load, when the caller has read it already)."""
    plan = plan or plan_load(path, head_prefix=head_prefix, trust_remote_code=trust_remote_code)
    config, index, detection, head = plan.config, plan.index, plan.detection, plan.head
    tensors = index.sidecar_tensors if detection.head_file else index.tensors
    initialised = would_initialise(head, detection)
    ignored = sorted(plan.projections - {key.removeprefix(detection.backbone_prefix) for key in detection.head_keys})
    return {
        "path": path,
        "format": detection.format,
        # The format's text says num_labels=1; an HL-Gauss head has a logit per bin.
        "description": detection.description if plan.stored_head is None else detection.description.replace(
            "num_labels=1", f"num_labels={plan.stored_head.num_bins}, an HL-Gauss head"),
        "storage": detection.storage,
        "family": config.model_type,
        "critic_class": critic_class(config).__name__,
        "hidden_size": text_hidden_size(config),
        "num_tensors": len(index.tensors),
        "weight_files": list(index.weight_files) + ([index.sidecar] if index.sidecar else []),
        "head": {key: list(tensors[key].shape) for key in detection.head_keys},
        "value_head": describe(plan.stored_head),
        "experts": describe_experts(config),
        "would_initialise": initialised,
        "ignored": ignored,
    }


def _print_inspection(info: dict) -> None:
    print(f"path          {info['path']}")
    print(f"format        {info['format']}  ({info['description']})")
    print(f"storage       {info['storage']}: {', '.join(info['weight_files'])} ({info['num_tensors']} tensors)")
    print(f"family        {info['family']} -> {info['critic_class']} (hidden size {info['hidden_size']})")
    head = ", ".join(f"{k} {v}" for k, v in info["head"].items()) or "none (a fresh head will be created)"
    print(f"head          {head}" + (f" ({info['value_head']})" if info["head"] else ""))
    if info["experts"]:
        print(f"experts       {info['experts']}")
    print(f"initialise    {', '.join(info['would_initialise']) or 'nothing'}")
    print(f"ignore        {', '.join(info['ignored']) or 'nothing'}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def load_options(p):
        p.add_argument("--head-prefix", help="the head is stored as <prefix>.weight (+ <prefix>.bias)")
        p.add_argument("--trust-remote-code", action="store_true", help="allow model code shipped with the checkpoint")

    p = sub.add_parser("inspect", help="format, family, head keys/shapes and what would be initialised")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print JSON")
    load_options(p)

    p = sub.add_parser("convert", help="any critic format -> HF *ForTokenClassification (safetensors)")
    p.add_argument("src")
    p.add_argument("dst", help="output directory; must not exist or be empty")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--fresh-head", action="store_true", help="ignore any head in SRC; start from a fresh one")
    p.add_argument("--adapter", help="a peft LoRA adapter of SRC (engine.export_adapter): merge it and take its head")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors file, in bytes (100000) or with a unit (500MB, 2G, 2GB, 1GiB); more is "
                        "written as model-0000k-of-0000n.safetensors + model.safetensors.index.json (default 5GB)")
    load_options(p)

    p = sub.add_parser("values", help="per-token values for some tokens, or for a whole rollout file",
                       description=f"Per-token values for some tokens, or for a whole rollout file. Both outputs "
                                   f"are aligned with the tokens: {ALIGNMENT}.")
    p.add_argument("path")
    p.add_argument("--tokens", help="token ids separated by spaces or commas (default: 12 random ids)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollouts", help="a rollout file (.parquet/.jsonl/.json, docs/DATA.md): values for every row")
    p.add_argument("--out", help="with --rollouts: the .parquet to write (input_ids, response_mask, values)")
    p.add_argument("--batch-size", type=int, default=16, help="with --rollouts: rows per forward pass")
    load_options(p)

    p = sub.add_parser("demo", help="write the embedded tiny Qwen2 model to OUT_DIR, inspect it, print values")
    p.add_argument("out_dir")
    p.add_argument("--family", default="qwen2", help="the tiny model's family (common/testdata/configs)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="its vocabulary (default the tiny config's 1000): your tokenizer's, so that real token ids "
                        "fit; then engine.model.path=OUT_DIR")
    return parser


def _print_values(path: str, tokens: str | None, seed: int, **load_kwargs) -> None:
    model, report = load_critic(path, **load_kwargs)
    print(report)
    vocab = model.config.get_text_config().vocab_size
    if tokens:
        ids = torch.tensor([parse_token_ids(tokens)])
        if int(ids.max()) >= vocab or int(ids.min()) < 0:
            raise CriticLoadError(f"--tokens must be ids in [0, {vocab}); got {tokens!r}")
    else:
        ids = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(seed))
    from ..learning.loss import shift_to_tokens
    from .values import compute_values

    with torch.no_grad():
        values = shift_to_tokens(compute_values(model, ids, torch.ones_like(ids)))
    print(f"tokens  {ids[0].tolist()}")
    print(f"values  {[round(v, 5) for v in values[0].tolist()]}  (shape {list(values.shape)}, {values.dtype})")
    print(f"        {ALIGNMENT}")


def parse_token_ids(text: str) -> list[int]:
    """'5 6 7', '5,6,7' or '5, 6, 7' -> [5, 6, 7]."""
    parts = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    bad = [p for p in parts if not p.lstrip("-").isdigit()]
    if bad or not parts:
        raise CriticLoadError(f"--tokens must be integer token ids separated by spaces or commas; got {text!r}")
    return [int(p) for p in parts]


def _refuse_unwritable(path: str, what: str) -> None:
    from ..storage.atomic_dir import unwritable_reason

    reason = unwritable_reason(os.path.dirname(os.path.abspath(path)) if what == "file" else path)
    if reason:
        raise CriticLoadError(f"cannot write {path}: {reason}; choose another destination")


def _padded_chunks(records: list[dict], batch_size: int):
    """(the file's row indices, input_ids, attention_mask, each row's multi_modal_inputs or None) of
    every `batch_size` records, right-padded, one chunk at a time."""
    for start in range(0, len(records), batch_size):
        chunk = records[start:start + batch_size]
        width = max(len(r["input_ids"]) for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, r in enumerate(chunk):
            ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"], dtype=torch.long)
            mask[i, :len(r["input_ids"])] = 1
        yield range(start, start + len(chunk)), ids, mask, [r.get("multi_modal_inputs") for r in chunk]


def rollout_values(path: str, rollouts: str, out: str, batch_size: int, **load_kwargs) -> None:
    """The critic's values for every row of a rollout file, written to a Parquet file.

    `values` is aligned with input_ids as in training: entry t is the critic's value for token t (read
    at position t - 1; entry 0 is 0), so the column can serve as the file's old_values.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    from ..learning.data import read_records, validate_records
    from ..learning.loss import shift_to_tokens
    from .values import compute_values

    if not out.endswith(".parquet"):
        raise CriticLoadError(f"--out {out}: write a .parquet file")
    if os.path.exists(out):
        raise CriticLoadError(f"{out} already exists; choose a new --out file")
    _refuse_unwritable(out, "file")
    records = read_records(rollouts)
    # The file is checked against the model's config.json before the (maybe large) model is loaded.
    critic = plan_load(path, **load_kwargs).config
    text = critic.get_text_config()
    for note in validate_records(records, text.vocab_size, rollouts, targets=False,
                                 max_positions=getattr(text, "max_position_embeddings", None)):
        print(note, file=sys.stderr)
    # Every row's images against its placeholders (a vision critic's rows need theirs), named by the
    # file's row, before the model is loaded or anything computed.
    for rows, ids, mask, images in _padded_chunks(records, batch_size):
        try:
            multimodal.check_rows(critic, ids, mask, multimodal.as_rows(images, len(ids)))
        except multimodal.RowError as error:
            raise CriticLoadError(f"invalid rollouts in {rollouts}: {error.in_rows(rows)}") from None
    model, report = load_critic(path, **load_kwargs)
    print(report, file=sys.stderr)
    values = []
    with torch.no_grad(), tqdm(total=len(records), desc="values", unit="rollout", file=sys.stderr) as bar:
        for _, ids, mask, images in _padded_chunks(records, batch_size):
            predictions = shift_to_tokens(compute_values(model, ids, mask, multi_modal_inputs=images))
            values += [predictions[i, :int(m.sum())].tolist() for i, m in enumerate(mask)]
            bar.update(len(ids))
    table = pa.table({"input_ids": [[int(t) for t in r["input_ids"]] for r in records],
                      "response_mask": [r["response_mask"] for r in records], "values": values})
    tmp = out + ".tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, out)
    print(f"wrote {out}: values for {len(records)} rollouts ({sum(len(v) for v in values)} tokens); {ALIGNMENT}")


def _convert(args) -> tuple[str, object, str]:
    """SRC to DST tensor by tensor: read from SRC's files and written into DST's as it goes
    (common/valuehead/sliced.py, save.write_critic), never the whole model in memory; a checkpoint
    that cannot be read by slices (.bin weights, an adapter to merge) is loaded whole first."""
    from .save import save_critic, write_critic
    from .safetensors_stream import TensorSpec, parse_size
    from .sliced import open_sliced

    options = dict(torch_dtype=DTYPES[args.dtype], head_prefix=args.head_prefix, fresh_head=args.fresh_head,
                   trust_remote_code=args.trust_remote_code, adapter_path=args.adapter)
    # a bad size is refused before anything is read
    max_shard_size = parse_size(args.max_shard_size, key="--max-shard-size")
    sliced = open_sliced(args.src, **options)
    if isinstance(sliced, str):
        model, report = load_critic(args.src, **options)
        out = save_critic(model, args.dst, max_shard_size=max_shard_size)
        return out, report, f"{model.config.architectures[0]}, num_labels={model.config.num_labels}"
    specs = [TensorSpec(name, shape, sliced.dtypes[name]) for name, shape in sliced.shapes.items()]
    out = write_critic(sliced.config, args.dst, specs, ((spec.name, sliced.read(spec.name)) for spec in specs),
                       max_shard_size=max_shard_size)
    return out, sliced.report, f"{architecture_name(sliced.config)}, num_labels={sliced.config.num_labels}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "inspect":
            info = inspect_checkpoint(args.path, head_prefix=args.head_prefix, trust_remote_code=args.trust_remote_code)
            print(json.dumps(info, indent=2)) if args.json else _print_inspection(info)
        elif args.command == "convert":
            from ..storage.atomic_dir import is_nonempty_dir

            if is_nonempty_dir(args.dst) or (os.path.exists(args.dst) and not os.path.isdir(args.dst)):
                raise CriticLoadError(f"{args.dst} already exists and is not empty; convert writes a new directory")
            _refuse_unwritable(args.dst, "directory")  # before loading what may be a large model

            out, report, architecture = _convert(args)
            print(report)
            print(f"wrote {out} ({architecture})")
        elif args.command == "values":
            load_kwargs = {"head_prefix": args.head_prefix, "trust_remote_code": args.trust_remote_code}
            if args.rollouts:
                if args.tokens or not args.out:
                    raise CriticLoadError("--rollouts needs --out FILE.parquet, and does not take --tokens")
                rollout_values(args.path, args.rollouts, args.out, args.batch_size, **load_kwargs)
            else:
                _print_values(args.path, args.tokens, args.seed, **load_kwargs)
        elif args.command == "demo":
            from ..storage.atomic_dir import is_nonempty_dir
            from ..testdata import save_tiny_causal_lm

            if is_nonempty_dir(args.out_dir) or (os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir)):
                raise CriticLoadError(f"{args.out_dir} already exists and is not empty; demo writes a new directory")
            path = save_tiny_causal_lm(args.family, args.out_dir, vocab_size=args.vocab_size)
            _print_inspection(inspect_checkpoint(path))
            print()
            _print_values(path, None, 0)
    except (ValueError, OSError, ImportError) as err:  # CriticLoadError and bad rollouts are ValueErrors
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
