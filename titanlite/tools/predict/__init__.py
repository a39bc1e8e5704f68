"""Predicting before a run: what a layout will need or give, from formulas and fake tensors.

    zero, activation_memory   bytes per rank: ZeRO-1/2/3 states, saved activations
    predict_memory            a whole step's peak on a fake process group (no GPU needed)
    planner                   choosing pp × dp × tp degrees for a model and a cluster
    goodput_model             goodput under failures: Young/Daly, restarts, spares

May import the core only."""
