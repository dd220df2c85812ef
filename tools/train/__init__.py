"""The training recipe of the embedded K3-architecture model (docs/design/trained_model.md)."""
