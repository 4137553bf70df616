"""Operations around runs: `apex run` (launch and supervise), `apex eval`, `apex plot`."""
