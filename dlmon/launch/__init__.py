"""Starting and steering the training: ``dlmon run`` (launch, headless session) and ``attach --inject``."""
