"""The optimizers' step(): ZenFlowAdamW and OffloadAdamW, the parameters and their device state,
column selection, host windows, the state format, and the slow reference of docs/semantics.md."""
