"""The loss and the release gate: following dpfx's outputs into the user's loss (``track``),
proving that it is a scaled sum of per-example terms (``check``) and reusing that proof
(``steady``), the loss captured with the model (``captured``, ``form``), Hugging Face's
``labels=`` losses (``hf_labels``), and the one owner of whether a backward may release
(``gate``)."""
