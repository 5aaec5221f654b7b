"""What dpfx knows about an ATen FX graph, used by every layer above: which dim of each value
holds the examples (``batch``), how nodes are added with their fake values (``emit``), the tags
dpfx puts on nodes (``tags``) and the normalized text of a graph (``printer``)."""
