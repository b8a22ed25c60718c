"""Stage 3, KV cache: byte layouts and the paged pools that hold them.

``specs`` builds each layer's KV-cache spec from a plugin's descriptors through
the native builder (``rtpcore_native``), with fp8 layouts chosen per layer;
``codecs`` packs and unpacks rows in exactly those layouts; ``pools`` allocates
a layer's blocks and reads and writes them. It hands the engine the per-layer
specs (to plan how many blocks fit) and the pools its model writes into.
"""
