"""Applications: the ``thc`` command, the training worker, the performance model."""
