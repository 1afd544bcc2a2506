"""pmsnap beside PyTorch on a real GPU ([gpu2] items 1 and 3): runs where
torch sees a CUDA device (scripts/gpu_check.sh), skips elsewhere; the rules
it checks are modelled on the CPU by the simulated device
(runtime_registration_test, conflict_async_ordering_test).

On the first GPU run, after pmsnap had opened a pool the next forward failed
with `CUDA error: resource already mapped`, and a pool opened after another
one received its copies in the old pool's pages. Here: pools opened, closed
and reopened in one process, each after pinned-memory work of the caller's
own (what DCP's stager and a CheckFreq snapshot do), each checkpointing
bit-exactly, with forward and backward running after each, and pmsnap
leaving torch's current device and stream as they were.
"""

import pytest
import torch

import pmsnap

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or
                                not pmsnap.cuda_support_compiled(),
                                reason="needs a CUDA device and a pmsnap build with CUDA")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 64)).cuda()


def _train(model, step, steps):
    for _ in range(steps):
        step.zero_grad()
        model(torch.randn(32, 64, device="cuda")).square().mean().backward()
        step.step()


def test_pools_opened_closed_and_reopened_leave_cuda_usable_and_hold_their_own_bytes(
        pool_path, tmp_path):
    stream_before = torch.cuda.current_stream()
    device_before = torch.cuda.current_device()
    for round_ in range(3):
        # The caller's own pinned-memory work between pools (a DCP stager's,
        # a CheckFreq snapshot's), freed again.
        pinned = torch.empty(8 << 20, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(torch.ones(8 << 20, dtype=torch.uint8, device="cuda"))
        del pinned
        path = str(tmp_path / f"lifetime{round_}.pool")
        model = _model()
        opt = pmsnap.CheckpointedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), path,
                                           model=model, device="cuda", every=1)
        _train(model, opt, 3 + round_)
        opt.close()
        assert torch.cuda.current_stream() == stream_before
        assert torch.cuda.current_device() == device_before
        # The next forward and backward of the caller run.
        _train(model, torch.optim.SGD(model.parameters(), lr=0.0), 1)
        torch.cuda.synchronize()
        state = pmsnap.load_state_dict(path)
        for name, p in model.named_parameters():
            assert torch.equal(state["model"][name], p.detach().cpu()), (round_, name)


def test_default_adam_keeps_step_on_the_cpu_and_restores_it_there(pool_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pmsnap.CheckpointedOptimizer(opt, pool_path, model=model, device="cuda",
                                      every=1) as copt:
        _train(model, copt, 4)
        want = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state.items()}
    model2 = _model()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
    with pmsnap.CheckpointedOptimizer(opt2, pool_path, model=model2, device="cuda") as copt2:
        copt2.restore()
        # Paired by parameter: optimizer.state's order is the order of the
        # first updates, which need not be the parameters' order.
        for p, p2 in zip(model.parameters(), model2.parameters()):
            for n, v in want[p].items():
                assert opt2.state[p2][n].device == v.device, n
                assert torch.equal(opt2.state[p2][n], v), n
        for a, b in zip(model.parameters(), model2.parameters()):
            assert torch.equal(a, b)
