"""`zenflow.initialize` and the DeepSpeed-style engine around the optimizers: checkpoints, LR
schedules, loss scaling, fp32 masters for plain optimizers, current weights for readers."""
