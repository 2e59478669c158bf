"""``diversed train``: train an ensemble head with RL on a task (see :mod:`diversed_ext.research.trainer`).

Its defaults are the library's own (:class:`~diversed_ext.research.trainer.TrainerConfig` and
:func:`~diversed_ext.research.recipes.build_trainer`). The options of a run are recorded in the trained head's head.json
as its recipe, and ``--recipe HEAD`` reruns them: ``diversed train --recipe smollm2-135m-lambda4 --data
PATH/gsm8k/train.jsonl`` trains the shipped head of that name again; any option given beside it wins.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .common import (UsageError, _add_model_arguments, _non_negative_float, _non_negative_int, _positive_float,
                     _positive_int, _require_writable_folder, _weight_of_untrained_head, eagle_drafter_asked,
                     library_defaults, pair_names)
from .experiments import _add_task_arguments, _experiment_setup

# Options of a run that do not change the head it trains, so a recipe leaves them out; and a folder of this machine
# (--drafter-path: the head records that drafter's folder name as its pair's draft).
NOT_IN_RECIPE = ("command", "recipe", "resume", "output_dir", "checkpoint_every", "data_from_recipe", "device",
                 "drafter_path")


def add_train_command(commands) -> None:
    from ..head import HEAD_INPUTS
    from ..research.objective import CLOSED_FORMS
    from ..research.recipes import build_trainer
    from ..research.trainer import TrainerConfig

    defaults = library_defaults(build_trainer, TrainerConfig)
    train = commands.add_parser("train", help="train an ensemble head with RL on a task")
    train.add_argument("--recipe", help="rerun the options recorded in a head's head.json (a shipped head's name or "
                       "a head folder); options given beside it win")
    _add_task_arguments(train)
    train.add_argument("--mix-in", metavar="TASK:DATA:N",
                       help="add the first N examples of another task to the pool batches are drawn from, each "
                       "prompted and rewarded by its own task (synthetic:train:3500: a third of the batches off "
                       "GSM8K's 7000); DATA as --data takes it")
    train.add_argument("--steps", type=_positive_int, default=defaults["steps"], help="default %(default)s")
    train.add_argument("--batch-size", type=_positive_int, default=defaults["batch_size"],
                       help="rollouts per step, decoded together (default %(default)s)")
    train.add_argument("--lr", type=_positive_float, default=defaults["learning_rate"],
                       help="AdamW learning rate (default %(default)s)")
    train.add_argument("--warmup-steps", type=_non_negative_int, default=defaults["warmup_steps"],
                       help="default %(default)s")
    train.add_argument("--acceptance-coef", type=_non_negative_float, default=defaults["acceptance_coef"],
                       help="lambda of the acceptance regulariser (default %(default)s)")
    train.add_argument("--fidelity-coef", type=_non_negative_float, default=defaults["fidelity_coef"],
                       help="weight of the fidelity (mean target log-prob per token) in the reward "
                       "(default %(default)s)")
    train.add_argument("--expected-fidelity-coef", type=_non_negative_float,
                       default=defaults["expected_fidelity_coef"],
                       help="mu of the closed-form expected next-token fidelity term of the loss (default %(default)s;"
                       " 0: off)")
    train.add_argument("--expected-kl-coef", type=_non_negative_float, default=defaults["expected_kl_coef"],
                       help="kappa of the expected divergence KL(nu || p) of the loss: what mixing in the draft costs "
                       "the target's law, which a colder output never lowers (default %(default)s; 0: off; needs "
                       "--closed-form linear)")
    train.add_argument("--closed-form", choices=CLOSED_FORMS, default=defaults["closed_form"],
                       help="the acceptance and expected-fidelity terms as written (linear), or their logistic "
                       "surrogate: the same per-token optimum, gradients that do not vanish where a saturated head is "
                       "wrong (default %(default)s)")
    train.add_argument("--epochs", type=_positive_int, default=defaults["epochs"],
                       help="optimiser updates per batch of rollouts (default %(default)s)")
    train.add_argument("--head-hidden", type=_positive_int, default=defaults["head_hidden"],
                       help="hidden width of the head (default: linear head)")
    train.add_argument("--head-inputs", choices=sorted(HEAD_INPUTS), default=defaults["head_inputs"],
                       help="what the head reads: both models' hidden states, distribution features of their "
                       "next-token distributions (entropies, largest probabilities, TV), or both (default %(default)s)")
    train.add_argument("--init-weight", type=_weight_of_untrained_head, default=defaults["init_weight"],
                       help="w of the untrained head, in (0, 1] (default %(default)s)")
    train.add_argument("--rollout", choices=("speculative", "mixture"), default=defaults["rollout"],
                       help="sample rollouts through the speculative loop or token by token (default %(default)s)")
    train.add_argument("--output-dir", help="checkpoints, log, curve, head/ (default runs/head, or runs/RECIPE)")
    train.add_argument("--checkpoint-every", type=_positive_int, default=defaults["checkpoint_every"],
                       help="default %(default)s")
    train.add_argument("--resume", action="store_true", help="continue from the checkpoint in --output-dir")
    _add_model_arguments(train, defaults)


def recorded_data_path(path: str) -> str:
    """What a recipe records of a data file: its folder and name (gsm8k/train.jsonl), not this machine's path to it."""
    return os.path.join(*Path(path).parts[-2:])


def recipe_of(args) -> dict:
    """The options of a train run that shape the head it trains (what head.json records)."""
    recipe = {name: value for name, value in sorted(vars(args).items())
              if name not in NOT_IN_RECIPE and value is not None and value is not False}
    if "data" in recipe:
        recipe["data"] = recorded_data_path(recipe["data"])
    if "mix_in" in recipe:
        task, data, count = mix_in_parts(recipe["mix_in"])
        recipe["mix_in"] = f"{task.name}:{recorded_data_path(data)}:{count}"
    return recipe


def mix_in_parts(spec: str):
    """(task, data, count) of a --mix-in TASK:DATA:N, the task a :class:`~diversed_ext.research.tasks.Task` (DATA
    may hold colons; a path's do no harm)."""
    from ..research.tasks import get_task

    name, colon, rest = spec.partition(":")
    data, colon_too, count = rest.rpartition(":")
    if not (colon and colon_too and name and data):
        raise UsageError(f"--mix-in {spec}: expected TASK:DATA:N, such as synthetic:train:3500")
    try:
        task = get_task(name)
    except ValueError as error:
        raise UsageError(f"--mix-in {spec}: {error}") from None
    if not count.isdigit() or int(count) < 1:
        raise UsageError(f"--mix-in {spec}: N must be an integer >= 1, got {count!r}")
    return task, data, int(count)


def _mixed_in_examples(args) -> list:
    """[(task, examples)] of --mix-in (none without it)."""
    from ..research.tasks import load_task_examples

    if args.mix_in is None:
        return []
    task, data, count = mix_in_parts(args.mix_in)
    try:
        return [(task, load_task_examples(task, data, count))]
    except (OSError, ValueError) as error:
        raise UsageError(f"--mix-in {args.mix_in}: {error}") from None


def _train_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return parser._subparsers._group_actions[0].choices["train"]


def _recipe_argv(recipe: dict, train: argparse.ArgumentParser, source: str) -> list:
    """A recipe as the command-line options that give it, each checked by the parser as if typed."""
    flags = {action.dest: action.option_strings[0] for action in train._actions if action.option_strings}
    argv = []
    for name, value in recipe.items():
        if name not in flags or name in NOT_IN_RECIPE:
            raise UsageError(f"--recipe {source}: the recipe names {name!r}, which diversed train does not take")
        if value is True:
            argv.append(flags[name])
        elif value is not False and value is not None:
            argv += [flags[name], str(value)]
    return argv


def with_recipe(parser: argparse.ArgumentParser, argv: list, args):
    """``args`` of ``diversed train --recipe HEAD ...``: the head's recorded options, then those given here."""
    from ..head import head_recipe

    try:
        recipe = head_recipe(args.recipe)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read --recipe {args.recipe}: {error}") from None
    if not recipe:
        raise UsageError(f"--recipe {args.recipe}: its head.json records no recipe")
    given = argv[argv.index("train") + 1:]
    merged = parser.parse_args(["train", *_recipe_argv(recipe, _train_parser(parser), args.recipe), *given])
    merged.data_from_recipe = args.data is None and merged.data is not None
    if merged.output_dir is None:
        merged.output_dir = os.path.join("runs", os.path.basename(os.path.normpath(args.recipe)))
    return merged


def run_train(args) -> int:
    from ..research.checkpoints import CheckpointError
    from ..research.objective import check_kl_options
    from ..research.recipes import build_trainer
    from ..research.trainer import TrainerConfig, distributed_session

    if not args.data and args.task != "humaneval":
        raise UsageError("train needs --data PATH (a jsonl of training examples)")
    if getattr(args, "data_from_recipe", False) and not os.path.isfile(args.data):
        raise UsageError(f"--recipe {args.recipe} trained on {args.data}, which is not here: pass --data PATH to "
                         "your copy of that file")
    if eagle_drafter_asked(args.drafter, args.drafter_path) and args.rollout == "mixture":
        raise UsageError("--rollout mixture: an EAGLE-3 drafter's q depends on the step of its round it drafts at, so "
                         "it rolls out through the speculative loop only (--rollout speculative)")
    try:
        check_kl_options(args.expected_kl_coef, args.closed_form)
    except ValueError as error:
        raise UsageError(f"--expected-kl-coef {args.expected_kl_coef:g} with --closed-form {args.closed_form}: "
                         f"{error}") from None
    args.output_dir = args.output_dir or "runs/head"
    if args.resume:
        _check_resume(args)
    mixed_in = _mixed_in_examples(args)
    task, examples, target, draft, tokenizer, eos = _experiment_setup(args)
    config = TrainerConfig(output_dir=args.output_dir, steps=args.steps, batch_size=args.batch_size,
                           learning_rate=args.lr, warmup_steps=args.warmup_steps,
                           acceptance_coef=args.acceptance_coef, fidelity_coef=args.fidelity_coef,
                           expected_fidelity_coef=args.expected_fidelity_coef, closed_form=args.closed_form,
                           expected_kl_coef=args.expected_kl_coef,
                           epochs=args.epochs, temperature=args.temperature, seed=args.seed,
                           checkpoint_every=args.checkpoint_every)
    # Under torchrun every rank joins the job here; train() releases DDP before the group is destroyed.
    with distributed_session():
        trainer = build_trainer(task, examples, target, draft, tokenizer, config, head_hidden=args.head_hidden,
                                init_weight=args.init_weight, head_inputs=args.head_inputs, max_draft=args.max_draft,
                                max_new_tokens=args.max_new_tokens, rollout=args.rollout, eos_token_id=eos,
                                pair=pair_names(args) or None, chat=not args.no_chat_template,
                                recipe=recipe_of(args), mixed_in=mixed_in)
        try:
            history = trainer.train(resume=args.resume)
        except CheckpointError as error:
            raise UsageError(f"--resume: {error}") from None
    if history:
        last = history[-1]
        print(f"step {last['step']}: mean w {last['mean_weight']:.3f}, expected acceptance "
              f"{last['expected_acceptance']:.3f}, task reward {last['task_reward']:.3f}, "
              f"fidelity {last['fidelity']:.3f}; head saved in {os.path.join(args.output_dir, 'head')}")
    return 0


def _check_resume(args) -> None:
    """--resume continues the run whose checkpoint is in --output-dir under that run's options, the recipe the
    checkpoint records: a flag that changes one is refused before any model loads, but a larger --steps (the output
    folder, --checkpoint-every and --device are no part of a recipe). A checkpoint that records no recipe (written
    before checkpoints did) is left to the trainer, which compares its configuration."""
    from ..research.checkpoints import CHECKPOINT_NAME, CheckpointError, load_checkpoint, resume_conflicts

    try:
        state = load_checkpoint(os.path.join(args.output_dir, CHECKPOINT_NAME))
    except CheckpointError as error:
        raise UsageError(f"--resume: {error}") from None
    recorded = state.get("recipe") if state is not None else None
    if not isinstance(recorded, dict):
        return
    current = recipe_of(args)
    changed = [f"--{name.replace('_', '-')} {recorded.get(name, 'unset')} (now {current.get(name, 'unset')})"
               for name in resume_conflicts(recorded, current)]
    if changed:
        raise UsageError(f"--resume: the checkpoint in {args.output_dir} was made with {', '.join(changed)}; resume "
                         "with those as they were (only --steps may grow) or train afresh in another --output-dir")


# ---- diversed train-drafter ---------------------------------------------------------------------------------------

DRAFTER_SIZES = (2048, 4096, 8192, 16384, 32768)  # draft vocabulary sizes whose coverage a run reports
BF16_TOLERANCE = 0.002  # the largest drop in held-out acceptance at which the head is saved in bfloat16
HOLDOUT_METRICS = ("top1_step", "accept_step", "accept_upper_step", "acceptance_rate")
BF16_CHECK_SEQUENCES = 16  # held-out sequences of that check (float32 arithmetic is slow on a small CPU)


def add_train_drafter_command(commands) -> None:
    """``diversed train-drafter``: its options' defaults are the recipe of the shipped EAGLE-3 head."""
    from ..research.drafter_data import generate_dataset
    from ..research.drafter_training import DrafterTrainConfig

    defaults = library_defaults(DrafterTrainConfig)
    data = library_defaults(generate_dataset)
    train = commands.add_parser("train-drafter", help="train an EAGLE-3 draft head for the default pair by "
                                "self-distillation on GSM8K training problems")
    train.add_argument("--out", required=True, help="folder for the head (config.json, model.safetensors), its log, "
                       "curve, summary and checkpoint")
    train.add_argument("--data", required=True, help="GSM8K training problems (train.jsonl; never the test split)")
    train.add_argument("--data-dir", help="where the generated continuations are cached, resumable (default: under "
                       "the model cache)")
    train.add_argument("--prompts", type=_positive_int, default=2048, help="training problems (default %(default)s)")
    train.add_argument("--holdout", type=_positive_int, default=64,
                       help="problems from the end of the file held out for the metrics (default %(default)s)")
    train.add_argument("--shards", type=_positive_int,
                       help="generate and use only the first N batches of problems (held-out batches first)")
    train.add_argument("--max-new-tokens", type=_positive_int, default=data["max_new_tokens"], help="default "
                       "%(default)s")
    train.add_argument("--top-k", type=_positive_int, default=data["top_k"], help="soft-label entries kept (default "
                       "%(default)s)")
    train.add_argument("--gen-batch", type=_positive_int, default=data["batch_size"], help="prompts sampled together "
                       "(default %(default)s)")
    train.add_argument("--draft-vocab", type=_positive_int, default=8192, help="draft vocabulary size (default "
                       "%(default)s)")
    train.add_argument("--steps", type=_positive_int, default=defaults["steps"], help="default %(default)s")
    train.add_argument("--batch-size", type=_positive_int, default=defaults["batch_size"],
                       help="sequences per step (default %(default)s)")
    train.add_argument("--lr", type=_positive_float, default=defaults["learning_rate"], help="default %(default)s")
    train.add_argument("--warmup-steps", type=_non_negative_int, default=defaults["warmup_steps"],
                       help="default %(default)s")
    train.add_argument("--ttt-steps", type=_positive_int, default=defaults["ttt_steps"],
                       help="draft steps unrolled in training (default %(default)s)")
    train.add_argument("--eval-every", type=_positive_int, default=defaults["eval_every"], help="default %(default)s")
    train.add_argument("--seed", type=_non_negative_int, default=0, help="default %(default)s")
    train.add_argument("--fp32-matmul", action="store_true", help="train with float32 matmuls (default bfloat16)")
    train.add_argument("--threads", type=_positive_int, help="torch threads (default: torch's choice; on a busy small "
                       "CPU one thread runs the small matmuls of decoding several times faster than two)")
    train.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")


def _default_data_dir(args) -> str:
    import hashlib
    import json

    from ..models import cache_root

    key = json.dumps([os.path.abspath(args.data), args.prompts, args.holdout, args.max_new_tokens, args.top_k,
                      args.gen_batch, args.seed])
    return str(cache_root() / "drafter-data" / hashlib.sha256(key.encode()).hexdigest()[:12])


def run_train_drafter(args) -> int:
    """Generates (or resumes) the self-distillation data, trains the head, evaluates it and saves it in --out."""
    import json

    import torch

    from ..decoding import eos_ids
    from ..models import load_default_pair
    from ..models.eagle3 import AUX_LAYERS_DEFAULT, Eagle3Config, Eagle3Head
    from ..research import drafter_data as data
    from ..research.drafter_training import DrafterTrainConfig, evaluate, init_from_target, prepare, train_drafter

    if os.path.basename(args.data).startswith("test"):
        raise UsageError(f"--data {args.data}: the drafter trains on the training split only (train.jsonl)")
    if not os.path.isfile(args.data):
        raise UsageError(f"--data {args.data}: no such file")
    _require_writable_folder("--out", args.out)
    if args.data_dir is not None:
        _require_writable_folder("--data-dir", args.data_dir)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, _, tokenizer = load_default_pair()
    try:
        prompts, holdout = data.gsm8k_prompts(tokenizer, args.data, limit=args.prompts, holdout=args.holdout,
                                              batch_size=args.gen_batch)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.shards:
        prompts = prompts[:args.shards * args.gen_batch]
    if len(prompts) <= holdout:
        raise UsageError(f"--shards {args.shards}: leaves no training problems after the {holdout} held out")
    folder = args.data_dir or _default_data_dir(args)
    settings = dict(max_new_tokens=args.max_new_tokens, aux_layer_ids=AUX_LAYERS_DEFAULT,
                    eos_ids=eos_ids(tokenizer, target), top_k=args.top_k, batch_size=args.gen_batch, seed=args.seed)
    meta = {"task": "gsm8k", "holdout": holdout, "target": "SmolLM2-135M-Instruct", "matmul": "bfloat16"}
    try:
        data.generate_dataset(data.bf16_matmul_copy(target), prompts, folder, meta=meta, **settings)
    except ValueError as error:
        raise UsageError(f"--data-dir {folder}: {error}") from None
    records = data.load_records(folder)[:len(prompts)]
    held, train = records[:holdout], records[holdout:]
    vocab = target.config.vocab_size
    draft_ids, coverage = data.draft_vocabulary(train, vocab, min(args.draft_vocab, vocab))
    torch.manual_seed(args.seed)
    config = Eagle3Config.from_target(target.config.to_dict(), draft_ids.numel(), AUX_LAYERS_DEFAULT)
    head = Eagle3Head(config, target.get_input_embeddings())
    head.set_draft_vocabulary(draft_ids)
    init_from_target(head, target)
    train_config = DrafterTrainConfig(output_dir=args.out, steps=args.steps, batch_size=args.batch_size,
                                      learning_rate=args.lr, warmup_steps=args.warmup_steps, ttt_steps=args.ttt_steps,
                                      seed=args.seed, eval_every=args.eval_every,
                                      autocast_bf16=not args.fp32_matmul)
    train_examples, held_examples = prepare(train, draft_ids, vocab), prepare(held, draft_ids, vocab)
    log = train_drafter(head, train_examples, held_examples, train_config, resume=args.resume)
    # bfloat16 storage: kept where it costs no acceptance, checked with float32 arithmetic on part of the held-out
    # problems (the full held-out metrics are the training log's last evaluation)
    check = held_examples[:BF16_CHECK_SEQUENCES]
    float_metrics = evaluate(head, check, args.ttt_steps)
    low = Eagle3Head(config, target.get_input_embeddings())
    low.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in head.state_dict().items()})
    low.set_draft_vocabulary(draft_ids)
    bf16_metrics = evaluate(low, check, args.ttt_steps)
    key = f"acceptance_rate_k{args.ttt_steps}"
    dtype = torch.bfloat16 if float_metrics[key] - bf16_metrics[key] <= BF16_TOLERANCE else torch.float32
    head.save_pretrained(args.out, dtype=dtype)
    recipe = {k: v for k, v in sorted(vars(args).items()) if k not in ("command", "out", "data_dir", "resume",
                                                                         "threads")}
    recipe["data"] = recorded_data_path(args.data)
    summary = {"recipe": recipe,
               "train_sequences": len(train), "holdout_sequences": len(held),
               "train_label_positions": sum(int(e["prob"].shape[0]) for e in train_examples),
               "draft_vocab": int(draft_ids.numel()), "draft_vocab_coverage": coverage,
               "coverage_by_size": data.coverage_curve(train, vocab, DRAFTER_SIZES),
               "holdout": {k: v for k, v in log[-1].items() if k.startswith(HOLDOUT_METRICS)},
               "bf16_check_sequences": len(check), "check_float32_weights": float_metrics,
               "check_bfloat16_weights": bf16_metrics,
               "saved_dtype": str(dtype).replace("torch.", "")}
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"saved": args.out, "dtype": summary["saved_dtype"], **summary["holdout"]}, indent=2))
    return 0
