"""Models for the LRA tasks: the Transformer encoder, its classifier and the dual encoder."""

from sparseflash.models.lra import (Block, Classifier, DualEncoderClassifier, Encoder, build_model,
                                    sinusoidal_positions)

__all__ = ["Block", "Classifier", "DualEncoderClassifier", "Encoder", "build_model",
           "sinusoidal_positions"]
