"""The training loop around the compiled graphs: the checks of what the loop does with a release
(``checks``), the optimizer step that noises and counts it (``optim``, with its noise source
``step_noise`` and the release's writer ``grads``), noise drawn outside the graph (``noise``),
Poisson sampling and virtual batches (``data``), user-level sampling (``users``), several
processes (``ranks``) and FSDP2-sharded models (``fsdp``)."""
