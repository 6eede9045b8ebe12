"""Training loops and tolerances of the tests that hold ZenFlowAdamW to torch's AdamW
(docs/semantics.md's equivalences): HP, STEPS steps, and AdamW on the window's mean gradient."""
import torch

STEPS = 24
TOL = dict(rtol=1e-5, atol=1e-6)
HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


def matrices(model):
    return [p for p in model.parameters() if p.ndim >= 2]


def vectors(model):
    return [p for p in model.parameters() if p.ndim < 2]


def assert_models_close(a, b):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, **TOL, msg=lambda m: f"{name}: {m}")


def train(model, loss_fn, opt, steps=STEPS):
    for t in range(steps):
        opt.zero_grad()
        loss_fn(model, t).backward()
        opt.step()


def train_accumulating(model, loss_fn, interval, matrix_lr=HP["lr"]):
    """torch AdamW: vectors every step; matrices every `interval` steps on the mean gradient."""
    vec_opt = torch.optim.AdamW(vectors(model), **HP)
    mat_opt = torch.optim.AdamW(matrices(model), **{**HP, "lr": matrix_lr})
    sums = [torch.zeros_like(p) for p in matrices(model)]
    for t in range(STEPS):
        model.zero_grad()
        loss_fn(model, t).backward()
        vec_opt.step()
        for s, p in zip(sums, matrices(model)):
            s += p.grad
        if (t + 1) % interval == 0:
            for s, p in zip(sums, matrices(model)):
                p.grad = s / interval
            mat_opt.step()
            for s in sums:
                s.zero_()
