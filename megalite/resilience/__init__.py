"""Long runs: fault injection, rollback past spikes and non-finite values, straggler reports."""
