"""Studies: a grid of pretraining runs (sizes, objectives, budgets, continued pretraining, seeds)
read from a study file (``spec``) and planned as a tree of training segments that share their
common steps exactly (``plan``, printed by ``render``)."""
