"""Prefill/decode disaggregation: a request's paged state handed from a prefill server to a decode
server over a transport (Mooncake's TransferEngine). See docs/pd.md.

  base.py            the contracts: each role's half as the server sees it, the engine calls, a transport
  protocol.py        the wire: rooms, errors, targets, the aux slot, logprobs; buffers registered alike
  fingerprint.py     the layout fingerprint compared at pairing, the prompt digest of each room
  checkpoint.py      the checkpoint digest inside the fingerprint
  transfer.py        a write's entries and its path (direct, staged, pack_only, unpack_only): the cost model
  mooncake/          the Mooncake transport backend (imports Mooncake only when a transport is created)
  bootstrap.py       the prefill's bootstrap endpoint (HTTP) decode servers pair through
  prefill.py         prefill rooms: this server's requests paired with decode servers' claims
  room.py            one room's state, shared by the three prefill modules
  prefill_send.py    engine thread: each step's finished pages become write jobs
  prefill_writer.py  the transfer worker: jobs written in order, rooms closed after their writes
  decode.py          decode: reserve pages, wait for the transfer, unpack, admit as running
  decode_peers.py    decode: connections to prefill bootstrap endpoints, heartbeat, room calls
  faults.py          the test hooks (None in production)
"""
