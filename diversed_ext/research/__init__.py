"""The research application on top of the library: tasks and rewards, the code sandbox, rollouts, the RL trainer of
the ensemble head, the evaluation harness, and reports (tables, standard errors, paired differences, plots).

    tasks, sandbox             data loaders, prompts and rewards (GSM8K, HumanEval in a sandbox, ROUGE, fidelity)
    teacher_forcing, objective what one training step computes from a batch of completions
    rollouts, trainer, checkpoints, recipes   the training run
    harness, report, plots     methods x prompts experiments and what they print and plot
    calibration                the calibration gap g and the target entropy reported beside fidelity
    divergence, fly_divergence, divergence_scores   each rule's per-position KL and TV to the target
    baselines                  the free baselines' frontiers on every plane, and each rule's distance above them
"""
