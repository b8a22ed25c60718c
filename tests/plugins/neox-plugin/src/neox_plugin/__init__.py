"""neox-plugin: GPT-NeoX (the Pythia family) served by rtpcore."""
