"""What a checkpoint's contents mean: the layouts and key translations of a full checkpoint
(``layouts``), the precision it is exported in (``export_dtype``), the model configuration it
records (``model_config``), and user data stored as plain data (``plain``)."""
