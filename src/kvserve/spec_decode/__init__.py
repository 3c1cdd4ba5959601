"""Speculative decoding: proposers (n-gram, draft model), exact rejection sampling, config."""

from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.ngram_proposer import NgramProposer
from kvserve.spec_decode.rejection_sampler import DraftBatch, RejectionSamplerOutput, rejection_sample

__all__ = ["SpeculativeConfig", "NgramProposer", "DraftBatch", "RejectionSamplerOutput", "rejection_sample"]
