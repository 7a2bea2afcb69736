"""Shared check of the compiled-only code paths: torch.compile (aot_eager backend, which
traces like inductor but runs the traced ops eagerly, so no C++ compiler is needed)."""

import torch


def assert_compiled_matches_eager(model, idx, rtol=1e-4, atol=1e-6):
    """model(idx, idx) compiled twice: one graph, no graph break, no recompile on the second
    call, and the eager loss and parameter gradients (model's .grad is left zeroed-then-set);
    then model(idx) under no_grad (evaluation, sampling) compiled twice: one more graph, still
    no graph break, and the eager logits."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model.zero_grad()
    _, loss = model(idx, idx)
    loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    compiled = torch.compile(model, backend='aot_eager')
    for _ in range(2):
        model.zero_grad()
        _, loss_c = compiled(idx, idx)
        loss_c.backward()
    assert counters['stats']['unique_graphs'] == 1
    assert sum(counters['graph_break'].values()) == 0
    torch.testing.assert_close(loss_c, loss)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[n], rtol=rtol, atol=atol)
    with torch.no_grad():
        logits = model(idx)[0]
        for _ in range(2):
            logits_c = compiled(idx)[0]
    assert counters['stats']['unique_graphs'] == 2
    assert sum(counters['graph_break'].values()) == 0
    torch.testing.assert_close(logits_c, logits, rtol=rtol, atol=atol)
