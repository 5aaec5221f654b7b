"""What runs: a proven graph lowered with Inductor under the conditions that keep it exact
(``inductor``), one C++ build per graph (``cpu_builds``), the warm start from the cache
(``warm``), which of its entries run as they are (``trust``), and the self-check of the
generated code against the proven graph (``selfcheck``)."""
