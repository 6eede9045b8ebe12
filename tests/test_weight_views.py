"""zenflow.host.weight_views: the views the optimizer writes weights through, made once per
parameter and storage."""
import torch

from zenflow.host.fingerprints import bits
from zenflow.host.weight_views import WeightViews


def test_a_write_through_the_view_lands_in_the_parameter_and_bumps_no_version():
    p = torch.nn.Parameter(torch.zeros(3, 4))
    views = WeightViews([p])
    version = p._version
    views[0][:, 1] = 2.0
    assert p._version == version   # (outside_writes tells the optimizer's writes by this)
    assert torch.equal(p.detach()[:, 1], torch.full((3,), 2.0))
    assert views[0] is views[0]    # made once


def test_new_storage_gets_a_new_view_and_new_bits():
    p = torch.nn.Parameter(torch.zeros(2, 3))
    views = WeightViews([p])
    old_view, old_bits = views[0], views.bits(0)
    p.data = torch.ones(2, 3)
    assert views[0] is not old_view
    views[0][0, 0] = 5.0
    assert p.detach()[0, 0] == 5.0 and old_view[0, 0] == 0.0
    assert views.bits(0) is not old_bits
    assert torch.equal(views.bits(0), bits(p.detach()))


def test_views_are_rows_by_columns_and_a_vector_is_one_row():
    conv = torch.nn.Parameter(torch.randn(4, 2, 3, 3))
    bias = torch.nn.Parameter(torch.randn(5))
    views = WeightViews([conv, bias])
    assert views[0].shape == (4, 18) and views[0].data_ptr() == conv.data_ptr()
    assert views[1].shape == (1, 5) and views[1].data_ptr() == bias.data_ptr()
    assert views.bits(1).dtype == torch.int32


def test_an_optimizer_writes_a_parameter_given_new_storage_between_steps():
    """`p.data = t` between steps: the step's writes land in t, the parameter's storage now."""
    import zenflow
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 8))
    opt = zenflow.ZenFlowAdamW([p], lr=0.1, topk_ratio=0.25, update_interval=1, worker=False,
                               full_warm_up_rounds=0, overlap_step=False)
    try:
        for _ in range(2):
            p.grad = torch.ones(4, 8)
            opt.step()
        fresh = torch.zeros(4, 8)
        p.data = fresh
        p.grad = torch.ones(4, 8)
        opt.step()
        assert p.data_ptr() == fresh.data_ptr()
        # every column moved from the adopted zeros: the device's own ones and the host's
        assert bool((fresh != 0).all()), fresh
    finally:
        opt.close()
