-- A tenant under erasure (DELETE /v1/admin/tenants/{id}, `mnemos tenant delete`) is marked first,
-- in the transaction that revokes its keys: no key can be created for it afterwards (a key made
-- while the erasure waited out the key cache outlived the erasure), and the summary sweep leaves
-- its sessions alone. The mark goes with the row at the end of the erasure; a failed erasure
-- keeps it until it is run again.
ALTER TABLE tenants ADD COLUMN erasing_at timestamptz;
