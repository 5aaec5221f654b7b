"""The loss and the release gate: following dpfx's outputs into the user's loss (``track``, over
the ``trace`` it records), the check at backward (``backward``): the loss's ``program``, its
cached ``verdicts``, the proof that it is a scaled sum of per-example terms (``check``) and its
reuse by its cache key (``verdict_key``), the scales a trainer ``arranged``; model inputs computed from the batch
(``inputs``); the loss captured with the model (``captured``, ``form``), Hugging Face's
``labels=`` losses (``hf_labels``), and the one owner of whether a backward may release
(``gate``)."""
