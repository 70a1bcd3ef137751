"""The command line's side of the EAGLE self-distillation recipe (``train-drafter --device``).

:func:`add_self_distill_arguments` adds the recipe's options to the ``train-drafter``
parser; :func:`run_self_distill` turns the parsed options into a
:class:`~agentspec.training.eagle.config.ScaleConfig`, loads the target on the device,
builds the prompts (:func:`~agentspec.training.eagle.prompts.build_prompt_pool`) and runs
:func:`~agentspec.training.eagle.recipe.run_recipe`. A GPU run is one shot, so every failure
after the start, loading included, is written to ``--report`` rather than lost.

It lives in :mod:`agentspec.training` (below the CLI layer) so that
:mod:`agentspec.cli.train_drafter` stays the one place that parses the subcommand and
picks a recipe; the workload data arrives as a
:class:`~agentspec.training.corpus.DrafterData` handed in by the console script.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from agentspec.errors import ConfigError
from agentspec.tokens import eos_ids
from agentspec.training.corpus import DrafterData
from agentspec.training.eagle.config import ScaleConfig
from agentspec.training.eagle.prompts import PromptPool, build_prompt_pool
from agentspec.training.eagle.recipe import run_recipe

__all__ = ["add_self_distill_arguments", "run_self_distill", "scale_config"]


def add_self_distill_arguments(parser: Any) -> None:
    """Add the ``--device`` recipe's options to the ``train-drafter`` parser.

    Args:
        parser: The ``train-drafter`` :class:`argparse.ArgumentParser`.
    """
    g = parser.add_argument_group(
        "self-distillation at scale (--kind eagle --device DEV)",
        "With --device, the target writes its own training text on that device (batched "
        "generation from chat prompts, the workload documents, the SWE-agent logs and "
        "tool-agent tasks), its features stay on the device, and the head trains on them "
        "for the rest of --minutes (agentspec/training/eagle/recipe.py, docs/hvd.md).")
    g.add_argument("--device", default=None,
                   help="cuda, cuda:N or cpu: run the self-distillation recipe there "
                        "(without it: the CPU teacher recipe above)")
    g.add_argument("--report", type=Path, default=None,
                   help="JSON report (written after every phase, errors included)")
    g.add_argument("--gen-batch", type=int, default=None,
                   help="prompts generated per batch (default 384 on CUDA, 8 on CPU; halved "
                        "on out-of-memory)")
    g.add_argument("--train-batch", type=int, default=None,
                   help="sequences per training step (default 48 on CUDA, 8 on CPU)")
    g.add_argument("--max-prompt", type=int, default=None,
                   help="longest prompt kept, its tail (default 768 on CUDA, 256 on CPU)")
    g.add_argument("--temperature", type=float, default=0.7,
                   help="temperature of the sampled rows (default 0.7; half the rows greedy)")
    g.add_argument("--gen-share", type=float, default=0.4,
                   help="share of the budget left after loading spent generating (default 0.4)")
    g.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")


def scale_config(args: argparse.Namespace) -> ScaleConfig:
    """The recipe's :class:`~agentspec.training.eagle.config.ScaleConfig` from the parsed
    options (CUDA and CPU defaults differ: a CPU run uses small batches).

    Args:
        args: The parsed ``train-drafter`` command line (``--device`` set).
    """
    cuda = str(args.device).startswith("cuda")
    return ScaleConfig(
        minutes=args.minutes, gen_share=args.gen_share,
        gen_batch=args.gen_batch or (384 if cuda else 8),
        max_prompt=args.max_prompt or (768 if cuda else 256),
        max_new_tokens=args.max_new_tokens or (256 if cuda else 64),
        temperature=args.temperature, train_rows=args.train_batch or (48 if cuda else 8),
        feature_rows=64 if cuda else 8, lr=args.lr, draft_vocab=args.draft_vocab,
        intermediate=args.head_intermediate, steps=args.steps, seed=args.seed,
        tail_s=8.0 if cuda else 3.0, log_every=50 if cuda else 10,
    )


def run_self_distill(args: argparse.Namespace, data: DrafterData,
                     render: Any = None) -> int:
    """The self-distillation recipe on ``args.device`` (:mod:`agentspec.training.eagle.recipe`):
    load, build prompts, then :func:`~agentspec.training.eagle.recipe.run_recipe`. Every
    failure after the start is written to ``--report``; returns 0 when a head was written.

    Args:
        args: The parsed ``train-drafter`` command line (``--device`` set).
        data: The workload data (documents, held-out benchmark prompts).
        render: ``(messages, tools) -> token ids`` (default: the target's chat template).

    Returns:
        The exit code: 0 when a head was written, else 1.
    """
    import shlex
    import sys
    import traceback

    from agentspec.models import agentspec_home, load_model_and_tokenizer
    from agentspec.training.corpus import training_prompts

    start = time.monotonic()
    cuda = str(args.device).startswith("cuda")
    cfg = scale_config(args)
    report: dict[str, Any] = {
        "command": shlex.join([Path(sys.executable).name, "-m", "agentspec.cli",
                               *sys.argv[1:]]) if sys.argv[1:] else None,
        "recipe": "eagle-self-distill", "status": "failed", "errors": [], "phases_s": {},
        "torch": torch.__version__,
    }
    report_path: Path | None = args.report

    def write() -> None:
        if report_path is not None:
            report_path.parent.mkdir(parents=True, exist_ok=True)
            report_path.write_text(json.dumps(report, indent=2, default=str))

    def log(line: str) -> None:
        print(line, flush=True)

    try:
        torch.manual_seed(cfg.seed)
        if cuda:
            if not torch.cuda.is_available():
                raise ConfigError(f"--device {args.device}: CUDA is not available here")
            torch.backends.cuda.matmul.allow_tf32 = True  # features and generation: TF32
            torch.backends.cudnn.allow_tf32 = True
            report["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
        model, tok, files = load_model_and_tokenizer(args.model, device=args.device)
        report["model"] = files.name
        report["phases_s"]["load_s"] = round(time.monotonic() - start, 1)
        log(f"[{time.monotonic() - start:6.1f}s] load: {files.name} on {args.device}")
        out = Path(args.out or agentspec_home() / "drafters" / f"{files.name}-eagle.safetensors")
        t0 = time.monotonic()
        folder = data.folder(args.data)
        report["data_folder"] = str(folder)
        if render is None:
            from agentspec.chat.templates import render_prompt

            def render(msgs: list[dict[str, Any]], tools: Any) -> list[int]:
                return render_prompt(tok, msgs, tools)

        docs = data.documents(folder, cfg.seed)
        chat = training_prompts(10**6, cfg.seed, data.held_out_prompts())
        pool: PromptPool = build_prompt_pool(
            render, docs, folder, chat, max_prompt=cfg.max_prompt, val_share=cfg.val_share,
            seed=cfg.seed, deadline=time.monotonic() + 60 * cfg.minutes * 0.05)
        report["phases_s"]["prompts_s"] = round(time.monotonic() - t0, 1)
        log(f"[{time.monotonic() - start:6.1f}s] prompts: {pool.counts()}")
        stops = eos_ids(tok)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (stops or [0])[0]
        report = run_recipe(model, pool, cfg, device=args.device, out=out,
                            target_name=files.name, stop_ids=stops, pad_id=int(pad),
                            start=start, report=report, report_path=report_path, log=log,
                            init_from=args.init_from)
    except Exception as exc:  # the one GPU shot must leave a report behind
        report.setdefault("errors", []).append({
            "phase": "setup", "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=8)[-3000:]})
        report["status"] = "failed"
        print(f"train-drafter: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    report["phases_s"]["total_s"] = round(time.monotonic() - start, 1)
    try:
        write()
    except OSError as exc:
        print(f"train-drafter: cannot write the report: {exc}", file=sys.stderr)
    after = report.get("eval_after") or {}
    if after:
        log(f"held-out top-1 agreement with the target: depth 1 {after['top1']:.3f}, depth 2 "
            f"{after.get('top1_depth2', 0):.3f}, depth 3 {after.get('top1_depth3', 0):.3f} "
            f"({int(after['positions']):,} positions)")
    log(f"status {report.get('status')}; report: {report_path}")
    return 0 if (report.get("head") or {}).get("written") else 1
