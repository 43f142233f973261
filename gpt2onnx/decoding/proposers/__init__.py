"""The proposers of speculative decoding, one module each behind one base (proposer), listed in all_proposers."""
