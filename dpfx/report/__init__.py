"""What dpfx tells its users about a model: every rewrite and graph (``explain``) and every
reason it cannot be trained privately (``validate``)."""
