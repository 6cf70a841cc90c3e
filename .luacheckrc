-- luacheck's settings for the Redis scripts (datagen/control/lua, workers/claim/lua); scripts/check runs
-- `luacheck` over every .lua file.
std = "lua51"
-- What Redis gives a script.
read_globals = {"redis", "KEYS", "ARGV", "cjson", "cmsgpack", "bit", "struct", "unpack"}
max_line_length = 110

-- The library's functions: the loader puts lib.lua before a script that starts `--! uses lib`, so
-- a script sees them as globals it cannot change.
local lib = {
  "job_incarnation", "counts_in", "leave_running", "partition_label", "tally", "count_in_job",
  "complete_if_ended", "finish_in_rq", "ack_in_job", "rejoin", "count_cancelled_queued",
}
files["datagen/control/lua"] = {read_globals = lib}
files["workers/claim/lua"] = {read_globals = lib}
-- In the library itself each function is used by the scripts, not by the library.
files["datagen/control/lua/lib.lua"] = {ignore = {"211"}}
