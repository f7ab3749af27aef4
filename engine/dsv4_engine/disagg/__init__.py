"""Prefill/decode disaggregation: a request's paged state handed from a prefill server to a decode
server over Mooncake's TransferEngine. See docs/pd.md."""
