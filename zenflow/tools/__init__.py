"""The `zenflow` command and what it runs (bench, finetune, check-config, selftest, estimate, the
demo). The library never imports this package."""
