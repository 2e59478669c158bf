"""``diversed train``: train an ensemble head with RL on a task (see :mod:`diversed_ext.research.trainer`).

Its defaults are the library's own (:class:`~diversed_ext.research.trainer.TrainerConfig` and
:func:`~diversed_ext.research.recipes.build_trainer`). The options of a run are recorded in the trained head's head.json
as its recipe, and ``--recipe HEAD`` reruns them: ``diversed train --recipe smollm2-135m-lambda4 --data
PATH/gsm8k/train.jsonl`` trains the shipped head of that name again; any option given beside it wins.
"""

from __future__ import annotations

import argparse
import os

from .common import (UsageError, _add_model_arguments, _non_negative_float, _non_negative_int, _positive_float,
                     _positive_int, _weight_of_untrained_head, library_defaults)
from .experiments import _add_task_arguments, _experiment_setup

# Options of a run that do not change the head it trains, so a recipe leaves them out.
NOT_IN_RECIPE = ("command", "recipe", "resume", "output_dir", "checkpoint_every", "data_from_recipe", "device")


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


def recipe_of(args) -> dict:
    """The options of a train run that shape the head it trains (what head.json records)."""
    return {name: value for name, value in sorted(vars(args).items())
            if name not in NOT_IN_RECIPE and value is not None and value is not False}


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
    from ..models import DEFAULT_PAIR
    from ..research.checkpoints import CheckpointError
    from ..research.recipes import build_trainer
    from ..research.trainer import TrainerConfig, distributed_session

    if not args.data and args.task != "humaneval":
        raise UsageError("train needs --data PATH (a jsonl of training examples)")
    if getattr(args, "data_from_recipe", False) and not os.path.isfile(args.data):
        raise UsageError(f"--recipe {args.recipe} trained on {args.data}, which is not here: pass --data PATH to "
                         "your copy of that file")
    args.output_dir = args.output_dir or "runs/head"
    task, examples, target, draft, tokenizer, eos = _experiment_setup(args)
    config = TrainerConfig(output_dir=args.output_dir, steps=args.steps, batch_size=args.batch_size,
                           learning_rate=args.lr, warmup_steps=args.warmup_steps,
                           acceptance_coef=args.acceptance_coef, fidelity_coef=args.fidelity_coef,
                           expected_fidelity_coef=args.expected_fidelity_coef, closed_form=args.closed_form,
                           epochs=args.epochs, temperature=args.temperature, seed=args.seed,
                           checkpoint_every=args.checkpoint_every)
    # Under torchrun every rank joins the job here; train() releases DDP before the group is destroyed.
    with distributed_session():
        trainer = build_trainer(task, examples, target, draft, tokenizer, config, head_hidden=args.head_hidden,
                                init_weight=args.init_weight, head_inputs=args.head_inputs, max_draft=args.max_draft,
                                max_new_tokens=args.max_new_tokens, rollout=args.rollout, eos_token_id=eos,
                                pair=None if args.target else DEFAULT_PAIR, chat=not args.no_chat_template,
                                recipe=recipe_of(args))
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
