"""A training script written the way DeepSpeedExamples' ZenFlow `finetune_llama.py` writes one,
unchanged (`import deepspeed`, `from deepspeed import comm as dist`, transformers'
`AutoModelForCausalLM.from_pretrained`, a DistributedSampler, the model's `.loss`), with a tiny
Llama that the test writes to a local folder instead of Llama-2, and a checkpoint saved and
resumed. Importing transformers runs its and accelerate's `is_deepspeed_available()` on the served
`deepspeed`; the script records what they answer. Run by tests/test_deepspeed_launch.py through
`zenflow launch`. Writes O/rank<r>.json."""
import argparse
import importlib.util
import json
import os
import random
import time

import deepspeed
import numpy as np
import torch
from accelerate.utils import is_deepspeed_available as accelerate_sees_deepspeed
from deepspeed import comm as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM
from transformers.integrations import is_deepspeed_available as transformers_sees_deepspeed


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class TextDataset(Dataset):
    def __init__(self, n=64, seq=8):
        g = torch.Generator().manual_seed(3)
        self.data = torch.randint(0, 32, (n, seq), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main(args):
    set_seed(args.seed)
    deepspeed.init_distributed()
    model = AutoModelForCausalLM.from_pretrained(args.model_name)
    dataset = TextDataset()
    sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(),
                                 rank=dist.get_rank(), shuffle=False)
    train_loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model_engine, optimizer, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters())
    model_engine.train()
    global_step, losses = 0, []
    for epoch in range(args.num_train_epochs):
        for step, batch in enumerate(train_loader):
            step_start = time.time()
            batch = {k: v.to(model_engine.device) for k, v in batch.items()}
            outputs = model_engine(**batch)
            loss = outputs.loss
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            global_step += 1
            if dist.get_rank() == 0 and step % 4 == 0:
                print(f"[Epoch {epoch}] Step {step}, Loss: {loss.item():.4f}, "
                      f"Time: {(time.time() - step_start) * 1000:.0f}ms")
    if args.save_on_rank_0_only:   # as DeepSpeed-ZenFlow's finetune_llama.py saves
        if dist.get_rank() == 0:
            model_engine.save_checkpoint(args.output_dir, client_state={"global_step": global_step})
        return
    model_engine.save_checkpoint(args.output_dir, client_state={"global_step": global_step})
    resumed_model = AutoModelForCausalLM.from_pretrained(args.model_name)
    resumed, _, _, _ = deepspeed.initialize(args=args, model=resumed_model,
                                            model_parameters=resumed_model.parameters())
    path, client_state = resumed.load_checkpoint(args.output_dir)
    batch = {k: v.to(model_engine.device) for k, v in dataset[0:8].items()}
    model_engine.eval()
    resumed.eval()
    with torch.no_grad():
        result = {"rank": dist.get_rank(), "losses": losses, "client_state": client_state,
                  "eval_loss": model_engine(**batch).loss.item(),
                  "resumed_eval_loss": resumed(**batch).loss.item(),
                  "deepspeed_checks": {
                      "find_spec": importlib.util.find_spec("deepspeed").name,
                      "transformers": transformers_sees_deepspeed(),
                      "accelerate": accelerate_sees_deepspeed()}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    resumed.destroy()
    model_engine.destroy()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--model_name", type=str, required=True)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--out", type=str, required=True)
    parser.add_argument("--save_on_rank_0_only", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    main(args)
