"""The save side: a partial checkpoint (one DCP directory per part, ``partial``) and a full one (a
Hugging Face directory, ``full``), and how their files are written: DCP's writer with errors that
name their file (``writer``), ``torch.save``'s bytes made once per tensor signature (``records``),
files checksummed as written (``stream``), safetensors shards planned from shapes (``shards``), and
the save planner that balances replicated tensors over the ranks (``planner``)."""
