"""What the tests share, written once: the independent references dpfx is compared against
(reference.py), the small models (models.py, swin.py), the loss idioms (loss_idioms.py), the
noise statistics (noise_stats.py), the sweep sizes (sweep.py) and the multi-process runner
(gloo_ranks.py). Nothing here imports a test file; test files import only from here."""
