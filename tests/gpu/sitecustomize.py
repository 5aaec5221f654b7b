"""For GPU machines whose torch predates the 2.13 that dpfx asks for (a lent machine's image had
2.11): its Triton launcher divides by zero for a 2-D tiled kernel whose y extent is 0 (a batch of
0), which torch 2.13 guards as written here. tests/gpu/check.sh puts this folder on PYTHONPATH for
such a torch only; it is never part of the package."""
try:
    import torch
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13):
        from torch._inductor.runtime import triton_heuristics as th

        def _generate(self, meta, *args, **kwargs):
            self.x_grid = self.ceildiv("xnumel", meta.get("XBLOCK"))
            self.prefix.extend([
                self.assign_tmp("y_grid_raw_", self.ceildiv("ynumel", meta.get("YBLOCK"))),
                self.assign_tmp("y_grid_div_", self.ceildiv("y_grid_raw_", th.get_max_y_grid()))])
            e = self.ceildiv("y_grid_raw_", "y_grid_div_")
            self.y_grid = f"(0 if y_grid_div_ == 0 else {e})" if self.mode == "python" \
                else f"(y_grid_div_ == 0 ? 0 : {e})"
            self.z_grid = "y_grid_div_"

        th.Grid2DWithYZOverflow.generate = _generate
except Exception as e:  # noqa: BLE001
    print("sitecustomize: patch not applied:", e)
