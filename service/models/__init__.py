"""The served models' lifecycle: the registry requests resolve names in, the repository of versions loaded,
swapped and released while serving, and each model's task mixes."""
