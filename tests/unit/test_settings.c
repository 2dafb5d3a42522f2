/* Unit test of daemon/settings: defaults, the config file, the environment
 * and flags in their order of precedence, bounds and errors that name their
 * source, the mode's default paths, SIGHUP's reload of mutable settings only,
 * and --dump-config's output read back as a config file. */
#include "daemon/settings.h"

#include "tests/check.h"

#include <stdlib.h>
#include <unistd.h>

static char dir[64];

static const char *write_conf(const char *name, const char *text)
{
	static char path[256];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	FILE *f = fopen(path, "w");
	if (!f) {
		perror(path);
		exit(1);
	}
	fputs(text, f);
	fclose(f);
	return path;
}

static void clear_env(void)
{
	const char *vars[] = {"TRAIND_CONFIG", "TRAIND_MODE", "TRAIND_SOCKET", "TRAIND_CPU_SLOTS",
			      "TRAIND_STATE_DIR", "TRAIND_VRAM_FACTOR", "RUNTIME_DIRECTORY",
			      "STATE_DIRECTORY", "CACHE_DIRECTORY", "XDG_STATE_HOME", "XDG_CACHE_HOME"};
	for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++)
		unsetenv(vars[i]);
}

static td_err load(struct dmn_config *c, struct td_errbuf *eb, int argc, ...)
{
	char *argv[16];
	va_list ap;
	va_start(ap, argc);
	for (int i = 0; i < argc; i++)
		argv[i] = va_arg(ap, char *);
	va_end(ap);
	memset(eb, 0, sizeof(*eb));
	return dmn_config_load(c, argc, argv, eb);
}

static void test_defaults_and_modes(void)
{
	struct dmn_config c;
	struct td_errbuf eb;
	clear_env();
	setenv("XDG_RUNTIME_DIR", "/run/user/4242", 1);
	setenv("HOME", "/home/someone", 1);
	setenv("XDG_CONFIG_HOME", dir, 1); /* no traind/traind.conf there */
	CHECK_EQ_INT(load(&c, &eb, 1, "--user"), TD_OK);
	CHECK_STR_EQ(c.socket, "/run/user/4242/traind.sock");
	CHECK_STR_EQ(c.state_dir, "/home/someone/.local/state/traind");
	CHECK_STR_EQ(c.cache_dir, "/home/someone/.cache/traind");
	CHECK_EQ_INT(c.socket_mode, 0600);
	CHECK_EQ_INT(c.cpu_slots, 1);
	CHECK_NEAR(c.vram_factor, 0.9, 0);
	CHECK_STR_EQ(c.admin_group, "traind-admin");

	setenv("XDG_STATE_HOME", "/xdg/state", 1);
	CHECK_EQ_INT(load(&c, &eb, 1, "--user"), TD_OK);
	CHECK_STR_EQ(c.state_dir, "/xdg/state/traind");

	CHECK_EQ_INT(load(&c, &eb, 2, "--mode", "system"), TD_OK);
	CHECK_STR_EQ(c.socket, "/run/traind/traind.sock");
	CHECK_STR_EQ(c.state_dir, "/var/lib/traind");
	CHECK_STR_EQ(c.cache_dir, "/var/cache/traind");
	CHECK_EQ_INT(c.socket_mode, 0666);
	/* systemd's directories win over the built-in ones. */
	setenv("STATE_DIRECTORY", "/var/lib/traind-x:/other", 1);
	setenv("RUNTIME_DIRECTORY", "/run/traind-x", 1);
	CHECK_EQ_INT(load(&c, &eb, 1, "--system"), TD_OK);
	CHECK_STR_EQ(c.state_dir, "/var/lib/traind-x");
	CHECK_STR_EQ(c.socket, "/run/traind-x/traind.sock");

	unsetenv("XDG_RUNTIME_DIR");
	CHECK_EQ_INT(load(&c, &eb, 1, "--user"), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "XDG_RUNTIME_DIR is not set");
	clear_env();
}

static void test_precedence(void)
{
	struct dmn_config c;
	struct td_errbuf eb;
	clear_env();
	setenv("XDG_RUNTIME_DIR", "/run/user/1", 1);
	const char *conf = write_conf("a.conf", "# comment\n"
						"cpu_slots = 3\n"
						"  vram_factor=0.5   # trailing comment\n"
						"admin_group = \"wheel\"\n"
						"socket = /tmp/from-file.sock\n");
	CHECK_EQ_INT(load(&c, &eb, 3, "--user", "--config", conf), TD_OK);
	CHECK_EQ_INT(c.cpu_slots, 3);
	CHECK_NEAR(c.vram_factor, 0.5, 0);
	CHECK_STR_EQ(c.admin_group, "wheel");
	CHECK_STR_EQ(c.socket, "/tmp/from-file.sock");
	CHECK_STR_EQ(c.config_file, conf);

	/* environment over file, flag over environment */
	setenv("TRAIND_CPU_SLOTS", "5", 1);
	CHECK_EQ_INT(load(&c, &eb, 3, "--user", "--config", conf), TD_OK);
	CHECK_EQ_INT(c.cpu_slots, 5);
	CHECK_EQ_INT(load(&c, &eb, 4, "--user", "--config", conf, "--cpu-slots=7"), TD_OK);
	CHECK_EQ_INT(c.cpu_slots, 7);
	CHECK_EQ_INT(load(&c, &eb, 5, "--user", "--config", conf, "--cpu-slots", "8"), TD_OK);
	CHECK_EQ_INT(c.cpu_slots, 8);
	/* TRAIND_CONFIG names the file when --config does not */
	setenv("TRAIND_CONFIG", conf, 1);
	unsetenv("TRAIND_CPU_SLOTS");
	CHECK_EQ_INT(load(&c, &eb, 1, "--user"), TD_OK);
	CHECK_EQ_INT(c.cpu_slots, 3);
	clear_env();
}

struct err_case {
	const char *file;   /* config text, or NULL */
	const char *flag, *val;
	const char *needle;
};

static void test_errors(void)
{
	static const struct err_case cases[] = {
		{"cpu_slots = 2\nnot_a_setting = 1\n", NULL, NULL, "b.conf:2: unknown setting 'not_a_setting'"},
		{"cpu_slots = many\n", NULL, NULL, "b.conf:1: cpu_slots: 'many' is not an integer"},
		{"cpu_slots 3\n", NULL, NULL, "b.conf:1: expected 'name = value'"},
		{"vram_factor = 1.5\n", NULL, NULL, "vram_factor: 1.5 is out of range 0.05 .. 1"},
		{"log_level = loud\n", NULL, NULL, "log_level: 'loud' is not one of err,warn,info,debug"},
		{"state_dir = relative/dir\n", NULL, NULL, "state_dir: 'relative/dir' is not an absolute path"},
		{NULL, "--cpu-slots", "5000", "--cpu-slots: cpu_slots: 5000 is out of range 0 .. 1024"},
		{NULL, "--socket-mode", "0999", "socket_mode: '0999' is not an octal number"},
		{NULL, "--no-such", "1", "unknown option '--no-such'"},
		{NULL, "--socket",
		 "/a/very/long/path/that/does/not/fit/into/the/sun_path/of/a/unix/socket/because/that/is/"
		 "only/108/bytes/long.sock",
		 "--socket: socket: 111 bytes, longer than the 107 allowed"}, /* 111 = strlen of the path */
	};
	clear_env();
	setenv("XDG_RUNTIME_DIR", "/run/user/1", 1);
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct dmn_config c;
		struct td_errbuf eb;
		td_err e;
		if (cases[i].file) {
			const char *p = write_conf("b.conf", cases[i].file);
			e = load(&c, &eb, 3, "--user", "--config", p);
		} else {
			e = load(&c, &eb, 3, "--user", cases[i].flag, cases[i].val);
		}
		CHECK_MSG(e == TD_EINVAL, "case %zu: %s", i, td_errname(e));
		CHECK_MSG(strstr(eb.msg, cases[i].needle), "case %zu: '%s' lacks '%s'", i, eb.msg,
			  cases[i].needle);
	}
	struct dmn_config c;
	struct td_errbuf eb;
	CHECK_EQ_INT(load(&c, &eb, 3, "--user", "--config", "/nonexistent/traind.conf"), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "/nonexistent/traind.conf");
	clear_env();
}

static void test_reload(void)
{
	clear_env();
	setenv("XDG_RUNTIME_DIR", "/run/user/1", 1);
	const char *p = write_conf("c.conf", "cpu_slots = 2\nsocket = /tmp/one.sock\n");
	char *argv[] = {(char *)"--user", (char *)"--config", (char *)p};
	struct dmn_config live;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(dmn_config_load(&live, 3, argv, &eb), TD_OK);
	write_conf("c.conf", "cpu_slots = 4\nsocket = /tmp/two.sock\nlog_level = debug\n");
	CHECK_EQ_INT(dmn_config_reload(&live, 3, argv, &eb), TD_OK);
	CHECK_EQ_INT(live.cpu_slots, 4);             /* mutable: taken */
	CHECK_STR_EQ(live.log_level, "debug");
	CHECK_STR_EQ(live.socket, "/tmp/one.sock");  /* immutable: kept */
	/* A bad file leaves everything as it was. */
	write_conf("c.conf", "cpu_slots = -1\n");
	CHECK_EQ_INT(dmn_config_reload(&live, 3, argv, &eb), TD_EINVAL);
	CHECK_EQ_INT(live.cpu_slots, 4);
	clear_env();
}

static void test_dump_reads_back(void)
{
	clear_env();
	setenv("XDG_RUNTIME_DIR", "/run/user/1", 1);
	struct dmn_config a, b;
	struct td_errbuf eb = {{0}};
	char *argv[] = {(char *)"--user", (char *)"--cpu-slots", (char *)"6", (char *)"--vram-factor",
			(char *)"0.75", (char *)"--socket-mode", (char *)"0660"};
	CHECK_EQ_INT(dmn_config_load(&a, 7, argv, &eb), TD_OK);
	char path[256];
	snprintf(path, sizeof(path), "%s/dump.conf", dir);
	FILE *f = fopen(path, "w");
	dmn_config_dump(&a, f);
	fclose(f);
	char *argv2[] = {(char *)"--user", (char *)"--config", path};
	CHECK_EQ_INT(dmn_config_load(&b, 3, argv2, &eb), TD_OK);
	CHECK_MSG(eb.msg[0] == 0, "%s", eb.msg);
	CHECK_EQ_INT(b.cpu_slots, 6);
	CHECK_NEAR(b.vram_factor, 0.75, 0);
	CHECK_EQ_INT(b.socket_mode, 0660);
	CHECK_STR_EQ(b.socket, a.socket);
	CHECK_STR_EQ(b.state_dir, a.state_dir);
	CHECK_STR_EQ(b.log_level, a.log_level);
	clear_env();
}

int main(void)
{
	snprintf(dir, sizeof(dir), "/tmp/td-settings.XXXXXX");
	if (!mkdtemp(dir)) {
		perror("mkdtemp");
		return 1;
	}
	test_defaults_and_modes();
	test_precedence();
	test_errors();
	test_reload();
	test_dump_reads_back();
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	if (system(cmd) != 0)
		fprintf(stderr, "warning: could not remove %s\n", dir);
	return check_status();
}
