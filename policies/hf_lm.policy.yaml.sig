{
  "payload": "eyJfdHlwZSI6Imh0dHBzOi8vZ292cmF5LmRldi9Qb2xpY3lTaWduYXR1cmUvdjEiLCJwb2xpY3lfbmFtZSI6ImhmLWxtIiwicG9saWN5X3NoYTI1NiI6IjcxYWNjMDU5OGNhYWRkMTcxYmFiZWM3OGFhYmNlY2ZhNjJjMTM3ZjJhNTM4OTM0MTI2MjQxZmJhYmQ2ZjRlYTMiLCJwb2xpY3lfdmVyc2lvbiI6MSwic2lnbmVkX2F0IjoiMjAyNi0xMS0yNFQwMTo0MToxNVoifQ==",
  "payloadType": "application/vnd.govray.policy-signature+json",
  "signatures": [
    {
      "keyid": "55ec9ba3972a762187a4f0830f1ba8297968ad327d4aa41ba37c0a6f738038b6",
      "sig": "PU9sWbzCKuTOCkexGTXW56McT6a4g4j63c9iPe61XraYzw9Ha4FUQmWaWOr9YwTFrWDm0aKx/gWeA7JxoYGrDA==",
      "signed_at": "2026-11-24T01:41:15Z"
    }
  ]
}
