"""One layer of each kind timed alone: the embedding, a block and the head (with the loss) of a run's model, forward
and forward + backward on one micro-batch, in this process at the pipeline's thread count. `bench pipeline` records
it beside real-compute results (``layer_profile``) so the cost model can split a stage's measured time among its
layers (`asyncpipe.timelines.cost_source.from_bench`): a stage's time is measured, but which part of stage 0's is
its embedding (a lookup forward, a dense vocabulary-sized gradient backward) is not; at a 20,480-token vocabulary on
`model=small` it is a fifth of a block's backward, and counting it as a block moves a cut's prediction by a few %."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up: allocations, lazy initialisation
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def layer_profile(cfg: Any, threads: int = 1, reps: int = 5) -> dict:
    """Seconds per micro-batch of ``cfg``'s embedding, one block and head + loss: ``{kind: [forward, backward]}``
    (backward = forward + backward timed together, less the forward; medians of ``reps``), with ``threads``
    and ``reps``. Weights and inputs from a fixed seed; gradients accumulate as in a pipeline's micro-batches."""
    import torch

    from asyncpipe.model.gpt import build_layers, lm_loss

    m, t = cfg.model, cfg.train
    vocab = int(m.vocab_size or cfg.tokenizer.vocab_size)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layers = build_layers(m, vocab, seed=0, indices=[0, 1, m.n_layer + 1])
        emb, block, head = layers[0], layers[1], layers[-1]
        gen = torch.Generator().manual_seed(0)
        shape = (int(t.micro_batch_size), int(t.seq_len))
        ids = torch.randint(0, vocab, shape, generator=gen)
        targets = torch.randint(0, vocab, shape, generator=gen)
        hidden = torch.randn(*shape, int(m.d_model), generator=gen, requires_grad=True)

        def passes(forward: Callable[[], torch.Tensor]) -> list[float]:
            def fwd() -> None:
                with torch.no_grad():
                    forward()

            def fwd_bwd() -> None:
                out = forward()
                out.backward(torch.ones_like(out) if out.dim() else None)

            f, fb = _median_ms(fwd, reps), _median_ms(fwd_bwd, reps)
            return [f, max(0.0, fb - f)]

        out = {
            "embedding": passes(lambda: emb(ids)),
            "block": passes(lambda: block(hidden)),
            "head": passes(lambda: lm_loss(head(hidden), targets)),
        }
    finally:
        torch.set_num_threads(before)
    return {**out, "threads": threads, "reps": reps, "micro_batch": list(shape)}
