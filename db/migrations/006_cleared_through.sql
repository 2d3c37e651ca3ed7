-- A reset or delete records the highest seq handed out when it committed: inbox entries up to it
-- belong to the cleared history, entries after it were accepted later and are kept, whatever
-- generation Redis stamped on them. So a crash between the commit and the Redis step (which
-- moves the inbox generation) can no longer make the drain drop messages accepted meanwhile.
ALTER TABLE sessions ADD COLUMN cleared_through_seq bigint NOT NULL DEFAULT 0;
