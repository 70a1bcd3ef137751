"""The ``agentspec train-drafter`` subcommand: collect teacher data, distil, save.

Usage::

    agentspec train-drafter                       # embedded model, 15 minutes, default --out
    agentspec train-drafter --minutes 5 --data ../shared/data --out my-drafter.safetensors
    agentspec train-drafter --traces traces.jsonl # add your own traces (see --help)

Extra traces (``--traces``, JSONL) hold one sequence per row, either as text,
``{"user": "...", "assistant": "..."}`` (teacher-forced on the assistant part), or as
token ids of the target's tokenizer, ``{"tokens": [...], "prompt_len": 12, "model": "..."}``
(teacher-forced from the last prompt token on; ``model``, when present, must name the
target).

``--kind eagle --device DEV`` runs the self-distillation recipe instead; its options and
its run live in :mod:`agentspec.training.eagle.command`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from agentspec.errors import ConfigError, TrainingDataError
from agentspec.tokens import eos_ids
from agentspec.training.corpus import DrafterData, TeacherSeq
from agentspec.training.drafter import TrainDrafterConfig
from agentspec.training.eagle.command import add_self_distill_arguments, run_self_distill

__all__ = [
    "DrafterData",
    "add_train_drafter_parser",
    "read_teacher_traces",
    "run_self_distill",
    "run_train_drafter",
]


def add_train_drafter_parser(sub: Any) -> None:
    """Register ``train-drafter`` on the ``agentspec`` subparsers ``sub``."""
    p = sub.add_parser(
        "train-drafter", help="train the model drafter from the target (CPU, minutes)",
        description="Trains a model drafter from the target. The target answers seeded "
                    "chat prompts and scores workload documents. --kind eagle (default): "
                    "one decoder layer on the target's final hidden states (EAGLE), "
                    "trained on the target's features with a soft cross-entropy and a "
                    "feature regression, two drafting depths deep; writes "
                    "<model>-eagle.safetensors (~9 MB). --kind distilled: LoRA deltas on the "
                    "target's first layers and a reduced head matched to its top-K "
                    "log-probs (KL); writes <model>.safetensors (~2 MB). The runtime loads "
                    "the EAGLE head when present, else the distilled drafter.",
    )
    d = TrainDrafterConfig()
    p.add_argument("--kind", choices=("eagle", "distilled"), default="eagle",
                   help="drafter to train (default eagle)")
    p.add_argument("--model", default=None,
                   help="target: a shipped model's name (default: embedded) or a local "
                        "Hugging Face folder")
    p.add_argument("--out", type=Path, default=None,
                   help="artifact path (default: $AGENTSPEC_HOME/drafters/<model>.safetensors, "
                        "where load_default_drafter looks first)")
    p.add_argument("--minutes", type=float, default=d.minutes,
                   help=f"wall-clock budget, collection + training (default {d.minutes})")
    p.add_argument("--data", default=None,
                   help="workload data folder (default: $AGENTSPEC_DATA or the packaged fixture)")
    p.add_argument("--traces", type=Path, default=None, help="extra traces, JSONL (see module doc)")
    p.add_argument("--prompts", type=int, default=d.prompts,
                   help=f"chat prompts the target answers, as time allows (default {d.prompts})")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"longest teacher answer (default {d.max_new_tokens}; with --device "
                        "256)")
    p.add_argument("--layers", type=int, default=d.num_layers,
                   help=f"target layers copied into the drafter (default {d.num_layers})")
    p.add_argument("--rank", type=int, default=d.rank, help=f"LoRA rank (default {d.rank})")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                   help=f"rows of the reduced head (default {d.draft_vocab})")
    p.add_argument("--head-intermediate", type=int, default=None,
                   help="--kind eagle: MLP width of the head (default: the target's; a "
                        "narrower head trains faster on a CPU and ships smaller)")
    p.add_argument("--teacher-cache", type=Path, default=None,
                   help="reuse the teacher data stored in this file, or store it there after "
                        "collecting (lets a second run spend its whole budget training)")
    p.add_argument("--steps", type=int, default=None,
                   help="exact training steps instead of 'until the budget ends'")
    p.add_argument("--init-from", type=Path, default=None,
                   help="--kind eagle: continue training this head artifact instead of "
                        "starting fresh (e.g. a second run with --teacher-cache)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_self_distill_arguments(p)


def read_teacher_traces(path: Path, tokenizer: Any, target_name: str, vocab: int,
                model: Any, top_k: int) -> list[TeacherSeq]:
    """Teacher sequences from a traces file (see the module doc).

    Raises:
        TrainingDataError: missing or empty file, a malformed row, ids outside the
            vocabulary or a trace made for another model (the message names file and line).
    """
    from agentspec.training.corpus import _topk, teacher_force

    if not path.is_file():
        raise TrainingDataError(f"traces file {path} does not exist")
    seqs: list[TeacherSeq] = []
    pairs: list[tuple[str, str]] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TrainingDataError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise TrainingDataError(f"{where}: expected an object, got {type(row).__name__}")
        if "tokens" in row:
            if row.get("model") not in (None, target_name):
                raise TrainingDataError(f"{where}: trace made for model {row['model']!r}, "
                                        f"not the target {target_name!r}")
            toks, plen = row["tokens"], row.get("prompt_len", 1)
            if not isinstance(toks, list) or len(toks) < 2 or not isinstance(plen, int):
                raise TrainingDataError(f"{where}: 'tokens' must list >= 2 ids and "
                                        "'prompt_len' be an int")
            bad = [t for t in toks if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise TrainingDataError(f"{where}: token id {bad[0]!r} is outside the "
                                        f"target's {vocab}-token vocabulary (another tokenizer?)")
            start = min(max(plen - 1, 0), len(toks) - 2)
            ids = torch.tensor([toks])  # [1, T]
            with torch.inference_mode():
                logits = model(input_ids=ids).logits[0, start:-1]  # [S, V]
            top_i, top_v = _topk(logits, top_k)
            seqs.append(TeacherSeq(torch.tensor(toks), start, top_i, top_v))
        elif isinstance(row.get("user"), str) and isinstance(row.get("assistant"), str):
            pairs.append((row["user"], row["assistant"]))
        else:
            raise TrainingDataError(f"{where}: a row needs 'tokens' or 'user' + 'assistant'")
    seqs += teacher_force(model, tokenizer, pairs, top_k=top_k)
    if not seqs:
        raise TrainingDataError(f"traces file {path} holds no trace")
    return seqs


def run_train_drafter(args: argparse.Namespace, data: DrafterData) -> int:
    """Collect teacher data, distil, save; print a summary. Returns the exit code.

    Args:
        args: The parsed command line (:func:`add_train_drafter_parser`).
        data: The workload data (documents, held-out benchmark prompts).
    """
    from agentspec.models import agentspec_home, load_model_and_tokenizer
    from agentspec.training.drafter import save_artifact, train_student

    if getattr(args, "device", None) is not None:
        if args.kind != "eagle":
            raise ConfigError("--device runs the EAGLE self-distillation recipe: use it "
                              "with --kind eagle")
        return run_self_distill(args, data)
    cfg = TrainDrafterConfig(
        minutes=args.minutes, num_layers=args.layers, rank=args.rank,
        draft_vocab=args.draft_vocab, prompts=args.prompts,
        max_new_tokens=args.max_new_tokens or TrainDrafterConfig.max_new_tokens,
        steps=args.steps, seed=args.seed,
    )
    torch.manual_seed(cfg.seed)
    start = time.monotonic()
    end = start + 60 * cfg.minutes
    collect_end = start + 60 * cfg.minutes * cfg.collect_share
    model, tok, files = load_model_and_tokenizer(args.model)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    suffix = "-eagle" if args.kind == "eagle" else ""
    out = args.out or agentspec_home() / "drafters" / f"{files.name}{suffix}.safetensors"
    folder = data.folder(args.data)
    show = not args.no_progress
    cache: Path | None = args.teacher_cache
    if cache is not None and cache.is_file():
        seqs = load_teacher(cache, files.name)
    else:
        seqs = _collect(args, data, cfg, model, tok, files.name, vocab, start, collect_end)
        if cache is not None:
            save_teacher(cache, seqs, files.name)
    collect_s = time.monotonic() - start
    eos = eos_ids(tok)
    if args.kind == "eagle":
        return _train_eagle(args, cfg, model, files.name, seqs, Path(out), eos, end, collect_s)
    spec, tensors, report = train_student(model, seqs, cfg, target_name=files.name,
                                          deadline=end, always=eos, progress=show)
    report.update(collect_s=round(collect_s, 1), total_s=round(time.monotonic() - start, 1),
                  data=str(folder), teacher_cache=str(cache) if cache else None)
    save_artifact(Path(out), spec, tensors, report)
    _print_summary(Path(out), report, len(seqs), collect_s)
    return 0


def _collect(args: argparse.Namespace, data: DrafterData, cfg: TrainDrafterConfig, model: Any,
             tok: Any, name: str, vocab: int, start: float,
             collect_end: float) -> list[TeacherSeq]:
    """Teacher data: ``--traces``, then documents, then chat answers, within the budget."""
    from tqdm.auto import tqdm

    from agentspec.training.corpus import teacher_force, teacher_generate, training_prompts

    show = not args.no_progress
    folder = data.folder(args.data)
    seqs = (read_teacher_traces(args.traces, tok, name, vocab, model, cfg.top_k)
            if args.traces else [])
    # A quarter of the collection time for documents, the rest for chat generations.
    docs = data.documents(folder, cfg.seed)
    doc_end = start + (collect_end - start) * 0.25
    with tqdm(total=len(docs), desc="score documents", unit="doc", disable=not show) as bar:
        seqs += teacher_force(model, tok, docs, top_k=cfg.top_k, deadline=doc_end,
                              tick=bar.update)
    prompts = training_prompts(cfg.prompts, cfg.seed, data.held_out_prompts())
    with tqdm(total=len(prompts), desc="target answers", unit="prompt",
              disable=not show) as bar:
        seqs += teacher_generate(model, tok, prompts, top_k=cfg.top_k,
                                 max_new_tokens=cfg.max_new_tokens, deadline=collect_end,
                                 tick=bar.update)
    return seqs


def _train_eagle(args: argparse.Namespace, cfg: TrainDrafterConfig, model: Any, name: str,
                 seqs: list[TeacherSeq], out: Path, eos: list[int], end: float,
                 collect_s: float) -> int:
    """Features, then the EAGLE head, then the artifact and a summary."""
    from tqdm.auto import tqdm

    from agentspec.drafters.model.distilled import embedding_checksum
    from agentspec.drafters.model.eagle import build_head, save_eagle
    from agentspec.drafters.model.eagle_head import HeadSpec
    from agentspec.training.drafter import choose_draft_vocab
    from agentspec.training.eagle import TrainEagleConfig, extract_features, train_head

    # Features may use at most half of what is left, so training always gets time.
    t0 = time.monotonic()
    with tqdm(total=len(seqs), desc="target features", unit="seq",
              disable=args.no_progress) as bar:
        data = extract_features(model, [s.tokens for s in seqs], cfg.max_len,
                                deadline=t0 + (end - t0) / 2, tick=bar.update,
                                starts=[s.start + 1 for s in seqs])
    if args.init_from is not None:  # continue training a head (same target)
        from agentspec.drafters.model.eagle import read_head

        head = read_head(model, args.init_from)
        draft_vocab = head.spec.draft_vocab  # the head keeps the vocabulary it was built with
    else:
        vocab = int(model.get_input_embeddings().weight.shape[0])
        draft_vocab = choose_draft_vocab(seqs, cfg.draft_vocab, vocab, eos)
        spec = HeadSpec.for_target(model, draft_vocab, name, embedding_checksum(model),
                                   intermediate=args.head_intermediate)
        head = build_head(model, spec)
        head.init_identity(cfg.seed)
    full = model.get_output_embeddings().weight.detach().float()  # [V, H]
    ecfg = TrainEagleConfig(steps=args.steps, seed=cfg.seed, max_len=cfg.max_len)
    report = train_head(head, data, full, ecfg, deadline=end, progress=not args.no_progress)
    save_eagle(out, head)
    size_mb = out.stat().st_size / 2**20
    b, a = report["val_before"], report["val_after"]
    print(f"EAGLE head written to {out} ({size_mb:.1f} MB, draft vocabulary {len(draft_vocab)})")
    print(f"data: {len(data)} sequences ({sum(int(d.tokens.shape[0]) for d in data):,} tokens) "
          f"collected in {collect_s:.0f} s; training: {report['steps']} steps, "
          f"{report['epochs']} epochs in {report['train_s']:.0f} s")
    print(f"held-out top-1 agreement with the target: depth 1 {b['top1']:.3f} -> "
          f"{a['top1']:.3f}, depth 2 {b['top1_depth2']:.3f} -> {a['top1_depth2']:.3f} "
          f"({int(a['positions'])} positions)")
    return 0


def save_teacher(path: Path, seqs: list[TeacherSeq], model_name: str) -> None:
    """Store teacher sequences (``torch.save``, tensors only) for later runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"tokens": s.tokens, "start": s.start, "top_ids": s.top_ids,
             "top_logp": s.top_logp} for s in seqs]
    torch.save({"model": model_name, "seqs": rows}, path)


def load_teacher(path: Path, model_name: str) -> list[TeacherSeq]:
    """Teacher sequences stored by :func:`save_teacher`.

    Raises:
        TrainingDataError: unreadable, empty, or collected from another model.
    """
    try:
        blob = torch.load(path, weights_only=True)
        rows, made_for = blob["seqs"], blob["model"]
    except Exception as exc:  # torch.load raises many types on a bad file
        raise TrainingDataError(f"teacher cache {path} is unreadable ({exc}); delete it") from None
    if made_for != model_name:
        raise TrainingDataError(f"teacher cache {path} was collected from {made_for!r}, not "
                                f"{model_name!r}; delete it or pass another --teacher-cache")
    if not rows:
        raise TrainingDataError(f"teacher cache {path} holds no sequence; delete it")
    return [TeacherSeq(r["tokens"], int(r["start"]), r["top_ids"], r["top_logp"]) for r in rows]


def _print_summary(out: Path, report: dict[str, Any], n_seqs: int, collect_s: float) -> None:
    from agentspec.drafters.model.distilled import describe

    info = describe(out)
    size_kb = Path(out).stat().st_size / 1024
    print(f"drafter written to {out} ({size_kb:.0f} KB, {info['trained_parameters']:,} trained "
          f"parameters, draft vocabulary {info['draft_vocab_size']})")
    print(f"teacher data: {n_seqs} sequences in {collect_s:.0f} s; training: "
          f"{report['steps']} steps, {report['epochs']} epochs in {report['train_s']:.0f} s")
    b, a = report["val_before"], report["val_after"]
    print(f"held-out top-1 agreement with the target: {b['top1']:.3f} -> {a['top1']:.3f} "
          f"(loss {b['loss']:.3f} -> {a['loss']:.3f}, {a['positions']} positions)")
