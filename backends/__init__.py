"""Training backends; each imports `common` and never another backend."""
