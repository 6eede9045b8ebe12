"""Settings and the DeepSpeed JSON config: the knobs, their defaults and the rules that check them.

Torch-free, so `zenflow check-config` stays light. `settings.ZenFlowSettings` is the one typed
config of the optimizers; `deepspeed_json` reads a DeepSpeed-style JSON file into it.
"""
