"""The GPU check: agentspec on one CUDA GPU within ``DEADLINE_S`` (default 480 s).

The quick bench in float32 and twice in bfloat16, a driven agent session, a step profile,
then one summary table. ``scripts/gpu_check.sh`` (or ``make gpu-check``) runs it as
``python3 -m workflows.bench.gpu_check`` from the checkout's root, with the standard library
only, so that a machine without a package index runs it with its system ``python3``::

    scripts/gpu_check.sh                          # from anywhere; results in results/gpu_check
    STEPS=bench-fp32 DEADLINE_S=240 scripts/gpu_check.sh
    DEVICE=cpu PY=.venv/bin/python STEPS=bench-fp32 WORKLOADS=chat METHODS=greedy,suffix \\
      EXTRA_BENCH_ARGS="--limit 1 --turns 1" scripts/gpu_check.sh     # the flow, on a CPU

A machine without a package index (torch and transformers preinstalled): stage the rest with
``scripts/gpu_stage/pack.sh`` and ``bash .gpu/pK/stage.sh`` first (docs/gpu.md); the check
takes ``/tmp/agentspec-stage/env.sh``'s environment itself for a Python outside a venv.

Python for the steps (:mod:`.interpreter`): ``$PY`` when set; else ``GPU_VENV``'s (default
``.venv-gpu``) when its torch sees a GPU; else the system ``python3`` when its torch sees a
GPU; else, only where a package index answers, it builds ``GPU_VENV`` with a CUDA torch from
PyPI (minutes; the deadline moves by the build time).

Steps (:mod:`.commands`; each under a time limit, logged to ``$OUT_DIR/<step>.log``; every
step is recorded in ``$OUT_DIR/steps.tsv`` with its status and exit code, and the check goes
on after a failing one):

- ``bench-fp32``: ``agentspec bench --quick --workloads $WORKLOADS --methods $METHODS
  --device $DEVICE --dtype float32 --out $OUT_DIR/bench-fp32.json``
- ``bench-bf16-a``, ``bench-bf16-b``: the same in bfloat16 with ``$BF16_METHODS`` (default
  ``$METHODS``: an EAGLE head trained on the fp32 weights serves them in bf16 too), plus
  ``$BF16_ARGS`` (default ``--limit 1``: one session of two turns per workload, so both bf16
  runs fit); run twice: the summary checks both gave the same tokens
- ``drive``: ``agentspec drive --methods $DRIVE_METHODS --reuse on --turns 10 --max-prompt
  4096 --max-tokens 64 --device $DEVICE --out $OUT_DIR/drive.json``
- ``profile``: ``scripts/step_profile.py --device $DEVICE --tokens 96``: a step's wall,
  device and drafter time, eager against shape-stable (+ CUDA graph), plain and suffix, fp32
  and bf16, and the top operators (``$OUT_DIR/step_profile.json``)
- summary: ``python -m workflows.report.gpu_check $OUT_DIR``: the table on stdout and
  ``$OUT_DIR/summary.json`` (always runs, within 60 s)

A bench or drive that fails (not one that runs out of time, not a drive whose variants
disagree) is retried once with the methods that do not need the EAGLE head
(``FALLBACK_METHODS`` / ``FALLBACK_DRIVE_METHODS``) when the time that the later steps do not
need allows it (``RETRY=0``: never).

Time (:mod:`.plan`): each step may run for its share of ``DEADLINE_S`` (``PCT_FP32`` 30,
``PCT_BF16`` 20 each, ``PCT_DRIVE`` 20, ``PCT_PROFILE`` 10 per cent) plus whatever the earlier
steps left unused, always keeping ``RESERVE_S`` (15) for the summary; a step that would have
less than ``MIN_STEP_S`` (default 20) before the deadline is skipped and reported as skipped.
``agentspec bench`` writes its JSON only at the end: a bench cut by its limit leaves nothing.

Environment (:mod:`.settings`): ``OUT_DIR`` (results/gpu_check), ``STEPS`` (bench, drive,
profile or step names; default "bench drive profile"), ``DTYPES`` ("float32 bfloat16"),
``DEADLINE_S`` (480), ``DEVICE`` (cuda; cpu runs the flow without a GPU), ``PY``, ``MODEL``
(a shipped model; default the embedded one), ``WORKLOADS`` (delegate52,tool_agent,chat),
``METHODS`` (greedy,prompt_lookup,suffix,hybrid,asd_b1), ``DRIVE_METHODS``
(plain,suffix,hybrid,ceiling), ``EXTRA_BENCH_ARGS``, ``BF16_METHODS``, ``BF16_ARGS``,
``EXTRA_DRIVE_ARGS``, ``HEAD`` (an EAGLE head file for hybrid / asd: the CLI has no flag for
one, so it is put where agentspec looks first, ``$AGENTSPEC_HOME/drafters/<model>-eagle
.safetensors``, for the run, and the file it replaced is put back at the end, also when a
step fails or the check is interrupted: :mod:`.head`), ``RETRY``, ``FALLBACK_METHODS``,
``FALLBACK_DRIVE_METHODS``, ``MIN_STEP_S``, ``RESERVE_S``, ``PCT_FP32``, ``PCT_BF16``,
``PCT_DRIVE``, ``PCT_PROFILE``, ``KEEP`` (1: keep the results of steps this run does not
repeat; default: the folder holds this run's only), ``GPU_VENV``, ``PYTHON``,
``TORCH_INDEX_URL``.

Exit (:mod:`.check`): 0 every step ok; 1 some step failed, ran out of time or was skipped; 2
no GPU, no usable Python or a setting that does not parse.
"""
