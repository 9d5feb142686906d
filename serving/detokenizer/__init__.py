"""The Detokenizer process: token ids from the Scheduler to text for the TokenizerManager, incrementally per
request, with stop strings."""
