"""Capturing the user's model with dynamo on one symbolic batch: the entry dynamo traces
(``entry``), the stand-ins for torch functions that cannot be traced on it (``swaps``,
``rnn``, ``requires_grad_skip``), the batch-size branches decided at capture
(``batch_branches``), module-level checks (``modules``) and dynamo's errors turned into the
user's (``errors``)."""
