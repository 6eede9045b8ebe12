"""`zenflow bench`: side-by-side step-time benchmark of offloading optimizers.

Modules: `model` (a small GPT and a synthetic token stream), `systems` (one runner per system,
run in a child process), `harness` (the rounds), `report` (statistics, targets, the table),
`plots` (PNG output), `cli`.
"""
