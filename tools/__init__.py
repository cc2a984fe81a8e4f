"""Tools built on the model library and the training application: the EP benchmark harness
(``tools.bench``) and the Sem-MoE passes (``tools.semmoe``). See docs/ARCHITECTURE.md."""
